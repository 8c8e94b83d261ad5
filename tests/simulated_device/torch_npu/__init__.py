"""Stand-in for Huawei's ``torch_npu`` (tests only): importing it, as ComfyUI's model_management does, installs the
simulated accelerator (``simulated_accelerator``) with its dispatch mode in every thread."""

import simulated_accelerator

simulated_accelerator.install()
simulated_accelerator.enter_in_every_thread()


def npu_fusion_attention(*args, **kwargs):
    """The name transformers imports where torch_npu is present (its NPU flash attention); never computed here: the
    tests' transformers models use eager attention."""
    raise NotImplementedError("the simulated accelerator has no npu_fusion_attention")
