"""The placement audit's "dynamic" load: ComfyUI's dynamic VRAM loader (``ModelPatcherDynamic``, on by default on
NVIDIA and ROCm >= 7.14 since comfy-aimdo) on FakeTensor ``cuda:0``.

``ModelPatcherDynamic.load`` decides placement in Python: every buffer and every parameter of a module ComfyUI does
not cast (and of casting modules up to 16 kB) is moved to the compute device; the weight and bias of larger casting
modules stay on the offload device and get a slot in comfy-aimdo's vbar (VRAM address space whose pages the native
library faults in). At call time ``comfy.ops.cast_bias_weight`` asks the vbar to fault the slot in: resident, the
weight is read from VRAM; out of VRAM, it is copied through a cast buffer. Either way the module's own ``weight``
attribute stays on the offload device, so placement findings (code reading ``module.weight.device`` or a tensor the
loader left behind) are the same whatever the vbar answers; only the weight traffic differs.

The native vbar needs a real CUDA device, so the audit stands in for it (as for ``torch.cuda.synchronize``): slots
are handed out, every fault answers "out of VRAM" (the weight is streamed on every call, the lowvram-like case), and
pinned host memory is off (``--disable-pinned-memory``: pinning changes where the host copy lives, not the device).
Not covered: the per-block prefetch queue and CUDA graphs (``comfy.model_prefetch``, H3 DiT and Music 3 AR), which
need a real stream and a resident vbar; ``load_on_device`` runs the real loader on a GPU.
"""

from __future__ import annotations

import contextlib


class StandInVBAR:
    """comfy-aimdo's ``ModelVBAR`` as the audit sees it: address space is handed out, VRAM is never there."""

    def __init__(self, size, device):
        self.max_size, self.offset = size, 0

    def prioritize(self, malloc_async_clamp=None):
        pass

    def alloc(self, num_bytes):
        self.offset = (self.offset + 511) & ~511
        slot = (self, self.offset, num_bytes)
        self.offset += num_bytes
        return slot

    def fault(self, alloc, size):
        return None  # comfy-aimdo's "VBAR_FAULT_OOM": ComfyUI copies the weight through a cast buffer

    def unpin(self, alloc, size):
        pass

    def loaded_size(self):
        return 0

    def free_memory(self, size_bytes):
        return 0


class StandInHostBuffer:
    """comfy-aimdo's pinned host buffer; unused with pinned memory off."""

    size = 0

    def __init__(self, *args):
        pass


@contextlib.contextmanager
def stand_ins():
    """comfy-aimdo enabled as ComfyUI's main.py enables it, with the stand-ins for its native parts."""
    import comfy.memory_management
    import comfy_aimdo.host_buffer
    import comfy_aimdo.model_vbar
    from comfy.cli_args import args

    with contextlib.ExitStack() as stack:
        for owner, name, value in ((comfy_aimdo.model_vbar, "ModelVBAR", StandInVBAR),
                                   (comfy_aimdo.host_buffer, "HostBuffer", StandInHostBuffer),
                                   (comfy.memory_management, "aimdo_enabled", True),
                                   (args, "disable_pinned_memory", True)):
            stock = getattr(owner, name)
            setattr(owner, name, value)
            stack.callback(setattr, owner, name, stock)
        yield


@contextlib.contextmanager
def real_aimdo():
    """comfy-aimdo started on the real GPU as ComfyUI's main.py starts it (for ``--audit`` on a CUDA machine)."""
    import comfy.memory_management
    import comfy.model_management
    import comfy_aimdo.control
    from comfy.cli_args import args

    if not comfy_aimdo.control.devctxs:
        comfy_aimdo.control.init()
        headroom = int(args.vram_headroom * 1024 ** 3)
        if not comfy_aimdo.control.init_devices((device.index, headroom)
                                                for device in comfy.model_management.get_all_torch_devices()):
            raise RuntimeError("comfy-aimdo did not start on this GPU (ComfyUI then falls back to the legacy loader)")
    stock = comfy.memory_management.aimdo_enabled
    comfy.memory_management.aimdo_enabled = True
    try:
        yield
    finally:
        comfy.memory_management.aimdo_enabled = stock


def load(model, device, offload_device):
    """``model`` loaded by ``ModelPatcherDynamic`` onto ``device``, as ``load_models_gpu`` does under dynamic VRAM."""
    import comfy.model_patcher

    patcher = comfy.model_patcher.ModelPatcherDynamic(model, load_device=device, offload_device=offload_device)
    patcher.load(device)
    return patcher
