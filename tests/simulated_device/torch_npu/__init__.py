"""Stand-in for Huawei's ``torch_npu`` (tests only): importing it, as ComfyUI's model_management does, installs the
simulated accelerator (``simulated_accelerator``) with its dispatch mode in every thread."""

import simulated_accelerator

simulated_accelerator.install()
simulated_accelerator.enter_in_every_thread()
