"""comfy_aimdo.control: initialisation and logging, with nothing native to set up."""

lib = None
devctxs: list[int] = []


def detect_vendor():
    """As the real one: the vendor the installed torch was built for (None for the CPU build the tests run)."""
    import torch

    version = torch.__version__
    return "cuda" if "+cu" in version else "rocm" if "+rocm" in version else None


def init(implementation: str | None = None, simple_vram_headroom: int | None = None, nvml_pressure: bool = False):
    return True


def init_devices(device_ids) -> bool:
    """``device_ids``: indices, or (index, VRAM headroom) pairs (comfy-aimdo >= 0.4.10)."""
    devctxs[:] = [entry[0] if isinstance(entry, tuple) else entry for entry in device_ids]
    return True


def init_device(device_id, extra_vram_headroom: int = 0):
    if device_id not in devctxs:
        devctxs.append(device_id)
    return True


def get_devctx(device_id: int) -> int:
    return device_id


def deinit():
    devctxs.clear()


def analyze():
    pass


def get_total_vram_usage() -> int:
    from . import model_vbar

    return sum(vbar.loaded_size() for vbar in model_vbar.all_vbars())


def _no_op():
    pass


set_log_none = set_log_critical = set_log_error = set_log_warning = set_log_info = set_log_debug = _no_op
set_log_verbose = set_log_vverbose = set_log_detail = _no_op
