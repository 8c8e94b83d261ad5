"""A simulated accelerator for tests: devices ``npu:0`` and ``npu:1`` whose tensors hold CPU data, so that ComfyUI
(started without ``--cpu``) adopts it through its own Ascend path and decides partial loads from its accounting.

* Device tensors are ``DeviceTensor`` wrappers (a ``torch.Tensor`` subclass reporting ``npu:N``) around a CPU tensor;
  every aten op runs on the wrapped CPU tensors, so values are exactly the CPU's. The ops are intercepted by
  ``SimulatedDeviceMode``, a dispatch mode entered per thread (``enter_in_every_thread``: ComfyUI runs prompts in a
  worker thread, and dispatch modes are thread-local), and by the subclass itself where no mode is active.
* An op given tensors of two devices raises the accelerator's error, as CUDA does; copies, 0-dim CPU tensors and
  CPU index tensors are allowed, as on CUDA.
* Memory: ``torch.npu.mem_get_info`` / ``memory_stats`` report the bytes of the live device tensors' storages
  against a total set per test (``set_total_mb``), which ComfyUI's ``get_total_memory`` / ``get_free_memory`` read.
* ``set_int_mm(False)``: the device has no ``torch._int_mm`` (the MPS error text), decided wherever device work runs
  on unwrapped tensors (a custom op's CPU body calls ``torch._int_mm`` from Python on plain tensors).
* ``BF16_ENV=0``: a device that computes fp16 but not bf16 (NVIDIA compute capability 7.x, AMD RDNA2, Intel XPU
  without bf16). ``torch.npu.is_bf16_supported()`` says no; ComfyUI 0.33.0 never asks an Ascend device (its
  ``should_use_bf16`` answers yes for any NPU), so the device's own custom node (``simulated_device_routes``) makes
  ComfyUI's ``should_use_bf16`` ask it, as ComfyUI's XPU path asks ``torch.xpu.is_bf16_supported()``. Values stay
  the CPU's in every dtype: what the device lacks is ComfyUI's choice of bf16, not the arithmetic.
* ``LAST_BIT_ENV=1``: a device whose kernels sum in another order than the CPU's, as a real GPU's do: every float
  result of a matmul or a convolution on the device is moved one unit in the last place (``torch.nextafter``
  towards +inf), so that its outputs differ from a ``--cpu`` run by what another reduction order gives, and
  amplifies, while two runs on the device still agree bit for bit.
* ``host_to_device()``: host-to-device copies per op (count, bytes) since ``reset_counters()``;
  ``host_to_device_by_shape()`` the same per source shape and dtype (``"2304x64 float16"``), so that a test can tell
  one tensor's traffic (a position table) from the weights'.

Test-only: the pack never imports it. The stand-in ``torch_npu`` package beside it installs it, and the test harness
puts this folder on the test ComfyUI's ``PYTHONPATH`` (``tests/hotfix_testing/comfyui_server.py``).
Configuration of a server process: the environment variables below.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE_TYPE = "npu"
TOTAL_MB_ENV = "MINIMAX_HOTFIX_SIMULATED_DEVICE_TOTAL_MB"
INT_MM_ENV = "MINIMAX_HOTFIX_SIMULATED_DEVICE_INT_MM"  # "0": the device has no torch._int_mm
BF16_ENV = "MINIMAX_HOTFIX_SIMULATED_DEVICE_BF16"  # "0": the device reports no bf16 (fp16 only)
LAST_BIT_ENV = "MINIMAX_HOTFIX_SIMULATED_DEVICE_LAST_BIT"  # "1": matmuls and convolutions differ in the last bit
CURRENT_ENV = "MINIMAX_HOTFIX_SIMULATED_DEVICE_CURRENT"  # the current device's index (ComfyUI loads models there)
DEVICE_COUNT = 2
DEVICE_NAME = "Simulated accelerator (CPU values)"
MIXED_DEVICES_ERROR = "Expected all tensors to be on the same device, but found at least two devices, {} and {}!"
MPS_INT_MM_ERROR = "The operator 'aten::_int_mm' is not currently implemented for the MPS device"

aten = torch.ops.aten
COPY_OPS = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten.copy.default,
            aten._copy_from_and_resize.default, aten.to.device, aten.to.dtype, aten.to.dtype_layout, aten.to.other}
REDUCING_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                aten.convolution.default}
INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}

PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

_state = threading.local()
_live: dict[int, weakref.ref] = {}  # id -> the device tensors alive (a WeakSet would compare tensors)
_total_bytes = {index: 0 for index in range(DEVICE_COUNT)}
_int_mm_available = True
_bf16_supported = True
_last_bit_differs = False
_default_device = 0
_host_to_device: dict[str, list[int]] = defaultdict(lambda: [0, 0])
_host_to_device_by_shape: dict[str, list[int]] = defaultdict(lambda: [0, 0])
_counter_lock = threading.Lock()


class DeviceTensor(torch.Tensor):
    """A tensor on the simulated device: reports ``npu:N``, holds its values in ``elem`` (a CPU tensor)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device):
        if elem.is_inference() and not torch.is_inference_mode_enabled():
            # a view of an inference tensor outside inference mode is an inference tensor, as on a real device
            with torch.inference_mode():
                return DeviceTensor.__new__(cls, elem, device)
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=device, requires_grad=elem.requires_grad)
        wrapper.elem = elem
        track(wrapper)
        return wrapper

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"DeviceTensor({self.elem!r}, device='{self.device}')"

    def tolist(self):
        # torch refuses ``tolist`` on wrapper subclasses (no dispatch reaches it); a real device copies to the host
        return self.elem.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return run_op(func, types, args, kwargs or {})


class SimulatedDeviceMode(TorchDispatchMode):
    """Runs every op with a device tensor or a device argument on the CPU; others as they are."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return run_op(func, types, args, kwargs or {})


def track(tensor: DeviceTensor) -> None:
    key = id(tensor)
    _live[key] = weakref.ref(tensor, lambda _, key=key: _live.pop(key, None))


def untrack(tensor: torch.Tensor) -> None:
    _live.pop(id(tensor), None)


def is_device(value) -> bool:
    return isinstance(value, torch.device) and value.type == DEVICE_TYPE


def device_of(value: torch.Tensor) -> torch.device:
    return value.device


def unwrap(value):
    return value.elem if isinstance(value, DeviceTensor) else value


def indexed(device: torch.device) -> torch.device:
    """``npu`` as ``npu:N`` (the current device), as a real backend reports its tensors' device."""
    return device if device.index is not None else torch.device(DEVICE_TYPE, BackendModule.current_device())


def to_cpu_device(value):
    return torch.device("cpu") if is_device(value) else value


def shape_key(tensor: torch.Tensor) -> str:
    """``"2304x64 float16"`` (``"scalar float32"`` for a 0-dim tensor)."""
    shape = "x".join(str(size) for size in tensor.shape) or "scalar"
    return f"{shape} {str(tensor.dtype).removeprefix('torch.')}"


def count_host_to_device(op: str, source: torch.Tensor) -> None:
    nbytes = source.numel() * source.element_size()
    with _counter_lock:
        for entry in (_host_to_device[op], _host_to_device_by_shape[shape_key(source)]):
            entry[0] += 1
            entry[1] += nbytes


def _target_device(func, args, kwargs):
    """The device an op puts its result on when it names one (factory ops, ``to``, ``_to_copy``), else None."""
    if func is aten.to.other:
        return args[1].device
    if func is aten.to.device:
        return torch.device(args[1])
    device = kwargs.get("device")
    return None if device is None else torch.device(device)


def check_same_device(func, flat) -> None:
    """Raises the accelerator's error when the op's tensors are on two devices (0-dim CPU tensors and CPU index
    tensors of index ops allowed, as on CUDA)."""
    found = []
    for value in flat:
        if not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DeviceTensor):
            device = value.device
        elif value.device.type == "cpu" and (value.dim() == 0 or func in INDEX_OPS):
            continue
        else:
            device = value.device
        if device.type == "meta":
            continue
        if device not in found:
            found.append(device)
    if len(found) > 1:
        devices = sorted(found, key=lambda device: device.type != DEVICE_TYPE)
        raise RuntimeError(MIXED_DEVICES_ERROR.format(devices[0], devices[1]) + f" (simulated device, in {func})")


def run_op(func, types, args, kwargs):
    if any(kind not in PLAIN_TYPES and not issubclass(kind, DeviceTensor) for kind in types):
        return NotImplemented  # another subclass (comfy-kitchen's QuantizedTensor) unpacks itself first
    flat, _ = tree_flatten((args, kwargs))
    on_device = [value for value in flat if isinstance(value, DeviceTensor)]
    target = _target_device(func, args, kwargs)
    if not on_device and not is_device(target) and not any(is_device(value) for value in flat):
        return func(*args, **kwargs)
    if func is aten._has_compatible_shallow_copy_type.default:
        # a CPU tensor's ``.data`` cannot take a device tensor: Module.to() must make new parameters
        return isinstance(args[0], DeviceTensor) is isinstance(args[1], DeviceTensor)
    if func is aten._int_mm.default and not _int_mm_available:
        raise NotImplementedError(MPS_INT_MM_ERROR)
    if func not in COPY_OPS:
        check_same_device(func, flat)
    if target is not None:
        result_device = indexed(target) if is_device(target) else None
    elif func is aten.copy_.default:
        result_device = args[0].device if isinstance(args[0], DeviceTensor) else None
    else:
        result_device = on_device[0].device if on_device else None
    plain_args = tree_map(lambda value: to_cpu_device(unwrap(value)), args)
    plain_kwargs = tree_map(lambda value: to_cpu_device(unwrap(value)), kwargs)
    with device_work():
        out = func(*plain_args, **plain_kwargs)
        if _last_bit_differs and func in REDUCING_OPS and out.is_floating_point():
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
    if func in COPY_OPS and result_device is not None:
        source = args[1] if func is aten.copy_.default else args[0]
        if isinstance(source, torch.Tensor) and not isinstance(source, DeviceTensor):
            count_host_to_device(func.overloadpacket.__name__, source)
    by_identity = {id(value.elem): value for value in on_device}

    def wrap(value):
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in by_identity:
            if by_identity[id(value)].device == result_device:  # in-place and out= ops return their argument
                return by_identity[id(value)]
            return value.clone()  # to the host: a copy, not the device tensor's own storage
        if result_device is None or value.device.type == "meta":
            return value
        return DeviceTensor(value, result_device)

    if func in COPY_OPS and out is plain_args[0] and isinstance(args[0], DeviceTensor) and (
            result_device == args[0].device):
        return args[0]  # ``to`` without a change returns its input
    return tree_map(wrap, out)


@contextlib.contextmanager
def device_work():
    """Marks the current thread as running device work on unwrapped tensors (for the no-``_int_mm`` mode)."""
    previous = getattr(_state, "device_work", False)
    _state.device_work = True
    try:
        yield
    finally:
        _state.device_work = previous


# -- what dispatch does not reach -------------------------------------------------------------------------------------

_torch_int_mm = torch._int_mm
_torch_tensor = torch.tensor
_TorchGenerator = torch.Generator


def _int_mm(a, b, *args, **kwargs):
    if not _int_mm_available and (getattr(_state, "device_work", False)
                                   or isinstance(a, DeviceTensor) or isinstance(b, DeviceTensor)):
        raise NotImplementedError(MPS_INT_MM_ERROR)
    return _torch_int_mm(a, b, *args, **kwargs)


def _tensor(data, *args, device=None, **kwargs):
    """``torch.tensor(..., device=npu)``: built on the CPU, then copied over (C++ builds it without dispatch)."""
    if device is not None and is_device(torch.device(device)):
        return _torch_tensor(data, *args, **kwargs).to(device)
    return _torch_tensor(data, *args, device=device, **kwargs)


class Generator(_TorchGenerator):
    """``torch.Generator(device=npu)``: a CPU generator (random ops on the device run on the CPU)."""

    def __new__(cls, device="cpu"):
        if is_device(torch.device(device)):
            device = "cpu"
        return _TorchGenerator.__new__(cls, device)

    def __init__(self, device="cpu"):
        pass


_tensor_data = torch._C.TensorBase.data


def _set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor.data = value`` between the host and the simulated device (ComfyUI's dynamic VRAM loader moves the
    parameters of modules that also have children with weights so). A real device changes the tensor's storage and
    device in place; here a device tensor is another kind of tensor, so the object's contents are swapped for a tensor
    of ``value`` (sharing its storage, as ``set_data`` does), a parameter staying a parameter."""
    if isinstance(tensor, DeviceTensor) is isinstance(value, DeviceTensor):
        _tensor_data.__set__(tensor, value)
        return
    if isinstance(tensor, torch.nn.Parameter):
        replacement = torch.nn.Parameter(value.detach(), requires_grad=tensor.requires_grad)
    else:
        replacement = value.detach().requires_grad_(tensor.requires_grad)
    untrack(tensor)  # swap_tensors refuses tensors with weak references
    untrack(replacement)
    torch.utils.swap_tensors(tensor, replacement)
    if isinstance(tensor, DeviceTensor):
        track(tensor)


# -- accounting --------------------------------------------------------------------------------------------------------

def allocated_bytes(index: int) -> int:
    storages = {}
    for ref in list(_live.values()):
        tensor = ref()
        if tensor is not None and tensor.device.index == index:
            storage = tensor.elem.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _index(device) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index or 0


def set_total_mb(total_mb: float, index: int | None = None) -> None:
    for device in (range(DEVICE_COUNT) if index is None else (index,)):
        _total_bytes[device] = int(total_mb * 1024 * 1024)


def set_current_device(index: int) -> None:
    """The device ComfyUI's ``get_torch_device()`` answers from now on (the models loaded next go there)."""
    global _default_device
    _default_device = index


def set_int_mm(available: bool) -> None:
    global _int_mm_available
    _int_mm_available = available


def set_bf16(supported: bool) -> None:
    global _bf16_supported
    _bf16_supported = supported


def set_last_bit_differs(differs: bool) -> None:
    global _last_bit_differs
    _last_bit_differs = differs


def reset_counters() -> None:
    with _counter_lock:
        _host_to_device.clear()
        _host_to_device_by_shape.clear()


def host_to_device() -> dict[str, list[int]]:
    """{op: [count, bytes]} of host-to-device copies since ``reset_counters``."""
    with _counter_lock:
        return {op: list(entry) for op, entry in _host_to_device.items()}


def host_to_device_by_shape() -> dict[str, list[int]]:
    """{"2304x64 float16": [count, bytes]} of host-to-device copies since ``reset_counters``, by source."""
    with _counter_lock:
        return {shape: list(entry) for shape, entry in _host_to_device_by_shape.items()}


def stats() -> dict:
    return {"current_device": _default_device, "total_bytes": dict(_total_bytes),
            "allocated_bytes": {index: allocated_bytes(index) for index in range(DEVICE_COUNT)},
            "int_mm": _int_mm_available, "bf16": _bf16_supported, "host_to_device": host_to_device(),
            "host_to_device_by_shape": host_to_device_by_shape()}


class BackendModule:
    """``torch.npu``: what ComfyUI calls on an Ascend device."""

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def is_initialized():
        return True

    @staticmethod
    def _is_in_bad_fork():
        return False

    @staticmethod
    def device_count():
        return DEVICE_COUNT

    @staticmethod
    def current_device():
        return getattr(_state, "current_device", _default_device)

    @staticmethod
    def set_device(device):
        _state.current_device = _index(device)

    @staticmethod
    def mem_get_info(device=None):
        index = _index(device)
        total = _total_bytes[index]
        return max(total - allocated_bytes(index), 0), total

    @staticmethod
    def memory_stats(device=None):
        allocated = allocated_bytes(_index(device))
        return {"reserved_bytes.all.current": allocated, "active_bytes.all.current": allocated,
                "allocated_bytes.all.current": allocated}

    @staticmethod
    def memory_allocated(device=None):
        return allocated_bytes(_index(device))

    @staticmethod
    def is_bf16_supported(including_emulation: bool = True):
        return _bf16_supported

    @staticmethod
    def get_device_name(device=None):
        return DEVICE_NAME

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def manual_seed(seed):
        pass

    @staticmethod
    def manual_seed_all(seed):
        pass

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, stream):
            pass

        def synchronize(self):
            pass

    class Event:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def wait(self, stream=None):
            pass

    @staticmethod
    def current_stream(device=None):
        return BackendModule.Stream()

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext()


# -- installation ------------------------------------------------------------------------------------------------------

_installed = False
_mode_threads: set[int] = set()


def install(clear_cuda_version: bool = True) -> None:
    """Registers the ``npu`` device and ``torch.npu`` (idempotent); patches ``torch.tensor``, ``torch.Generator``,
    ``torch._int_mm`` and the ``Tensor.data`` setter (each unchanged for other devices); clears ``torch.version.cuda``
    so that ComfyUI does not take a CUDA build of torch for an NVIDIA machine (``clear_cuda_version``). Reads the
    environment's total, ``_int_mm`` and bf16 settings."""
    global _installed, _default_device
    if _installed:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE, backend_module=BackendModule)
    torch.tensor = _tensor
    torch.Generator = Generator
    torch.Tensor.data = property(_tensor_data.__get__, _set_data)
    torch._int_mm = _int_mm
    if clear_cuda_version:
        torch.version.cuda = None
    set_total_mb(float(os.environ.get(TOTAL_MB_ENV, "2048")))
    set_int_mm(os.environ.get(INT_MM_ENV, "1") != "0")
    set_bf16(os.environ.get(BF16_ENV, "1") != "0")
    set_last_bit_differs(os.environ.get(LAST_BIT_ENV, "0") == "1")
    _default_device = int(os.environ.get(CURRENT_ENV, "0"))
    _installed = True


def enter_mode_in_this_thread() -> None:
    if threading.get_ident() not in _mode_threads:
        SimulatedDeviceMode().__enter__()  # held for the thread's life
        _mode_threads.add(threading.get_ident())


def enter_in_every_thread() -> None:
    """The mode in the calling thread and in every thread started later (ComfyUI's prompt worker)."""
    enter_mode_in_this_thread()
    bootstrap = threading.Thread._bootstrap_inner
    if getattr(bootstrap, "simulated_device", False):
        return

    def bootstrap_with_mode(self):
        enter_mode_in_this_thread()
        bootstrap(self)

    bootstrap_with_mode.simulated_device = True
    threading.Thread._bootstrap_inner = bootstrap_with_mode
