"""Self-test of int8_full_precision_mm. Red: a stock int8 layer reaches torch._int_mm where it is missing (the
accelerator if it lacks the op, else CPU with the op simulated away: comfy-kitchen's CPU backend calls torch._int_mm,
its CUDA one does not). Green: the fix matches a linear with the dequantized weight; where int8 compute exists the
fused kernel runs. Without ComfyUI the same checks run on comfy-kitchen's int8 linear itself, diverted by the pack's
kernel. Also what simulating a device without ``torch._int_mm`` needs and the running pack never does, for this
self-test, the tests and the benchmark: ``forget_int8_probes`` and ``unwrap_linear_input_act``."""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch
import torch.nn.functional as F

from ...contract import AttributeOverride, Check, State, remove_handles
from ...contract.comfy import comfy_module
from ...kernels import int8_full_precision_mm as int8_kernel
from ...kernels.int8_full_precision_mm import (
    MARK,
    DequantizedLinear,
    dequantizer,
    equal_within_fp32_rounding,
    int8_compute_available,
    probe_paths,
    result_or_error,
)
from ...patches.int8_full_precision_mm import FIX
from ..devices import real_accelerator

MPS_INT_MM_ERROR = "The operator 'aten::_int_mm' is not currently implemented for the MPS device."


def forget_int8_probes() -> None:
    """Make the next ``int8_compute_available`` call probe again, for code that swaps ``torch._int_mm`` (this
    self-test's simulated device, the tests, the benchmark). The running pack never forgets a device's answer."""
    with int8_kernel._probe_lock:
        int8_kernel._int8_compute.clear()


def unwrap_linear_input_act() -> None:
    """Put the original ``comfy.ops.linear_input_act`` back, unless another pack has wrapped ours since (removing ours
    would drop theirs; ours passes every unmarked layer straight through). The running pack keeps its wrapper for the
    rest of the process; this self-test, the tests and the benchmark remove it after diverting layers."""
    ops = comfy_module("comfy.ops")
    ours = getattr(getattr(ops, "linear_input_act", None), MARK, None)
    if ours is not None and ops.linear_input_act is ours:
        ops.linear_input_act = ours.__wrapped__


def self_test():
    ops = comfy_module("comfy.ops")
    if ops is None:
        if importlib.util.find_spec("comfy_kitchen") is not None:
            yield from red_green_checks(kernel_probe, "comfy-kitchen's int8 F.linear", "the int8 layer computes")
        return
    state = FIX.detect().state
    if state not in (State.NEEDED, State.FIXED_UPSTREAM):
        yield Check(f"not run: {state.value}", passed=state is State.NOT_APPLICABLE)
        return
    yield from red_green_checks(functools.partial(core_probe, ops),
                                "a stock int8 layer in forward and linear_input_act", "both paths compute",
                                fixed_upstream=state is State.FIXED_UPSTREAM)


def core_probe(ops, device, **options):
    """The fix's probe layer of the running core, with a context manager under which it is diverted as the fix
    diverts an injected model's layers."""
    paths, reference, layer = probe_paths(ops, device, **options)
    return list(paths.values()), reference, functools.partial(divert, layer)


@contextlib.contextmanager
def divert(layer):
    """``layer`` diverted as an injected model's would be; the wrapper is removed again if it was not there."""
    ops = comfy_module("comfy.ops")
    was_installed = getattr(ops.linear_input_act, MARK, None) is not None
    handles = FIX.divert_int8_layers(torch.nn.ModuleList([layer]))
    try:
        yield
    finally:
        remove_handles(handles)
        if not was_installed:
            unwrap_linear_input_act()


def red_green_checks(probe, stock_name: str, fixed_name: str, fixed_upstream=False):
    """The self-test steps for ``probe(device, full_precision_mm) -> (paths, reference, diverted)``: the call paths
    of one int8 layer on ``device``, their fp32 reference with the dequantized weight, and a context manager under
    which the layer is diverted as the fix diverts it."""
    accelerator = real_accelerator()
    native = accelerator if accelerator is not None and int8_compute_available(accelerator) else None
    lacking = accelerator if accelerator is not None and native is None else torch.device("cpu")
    with torch.no_grad(), int8_gemm_missing(lacking) as how:
        paths, reference, diverted = probe(lacking, full_precision_mm=fixed_upstream)
        stock = [result_or_error(path) for path in paths]
        if fixed_upstream:
            yield Check(f"fixed upstream: both paths run without torch._int_mm ({how})",
                        passed=all(isinstance(out, torch.Tensor) and equal_within_fp32_rounding(out, reference) for out in stock))
            return
        yield Check(f"red: {stock_name} reaches torch._int_mm ({how})",
                    passed=all(isinstance(out, Exception) and "_int_mm" in str(out) for out in stock),
                    detail=" / ".join(str(out).splitlines()[0] if isinstance(out, Exception) else "no error"
                                      for out in stock))
        with diverted():
            fixed = [path() for path in paths]
        yield Check(f"green: with the fix {fixed_name} with the dequantized weight",
                    passed=all(equal_within_fp32_rounding(out, reference) for out in fixed),
                    detail=f"max abs diff {max((out - reference).abs().max().item() for out in fixed):.1e}")
    native = native or (torch.device("cpu") if int8_compute_available("cpu") else None)
    if native is None:
        return
    with torch.no_grad():
        paths, reference, diverted = probe(native, full_precision_mm=False)
        stock = [path() for path in paths]
        with diverted():
            kept = [path() for path in paths]
    # the fused kernel's int8 activation rounding is what sets its result apart from the dequantized reference
    yield Check(f"green: where {native} has torch._int_mm the fused int8 kernel still runs",
                passed=all(torch.equal(out, ref) and not equal_within_fp32_rounding(out, reference) for out, ref in zip(kept, stock, strict=True)))


def kernel_probe(device, full_precision_mm: bool):
    """Without ComfyUI: a torch Linear holding a comfy-kitchen int8 weight (``F.linear`` dispatches it to
    comfy-kitchen's ``int8_linear``), diverted by the pack's ``DequantizedLinear``. ``full_precision_mm`` is a core
    setting: there is no core here to honour it."""
    from comfy_kitchen.tensor import QuantizedTensor

    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).to(device)
    layer = torch.nn.Linear(64, 16, bias=False, device="meta")  # its weight is replaced: nothing to draw
    layer.weight = torch.nn.Parameter(QuantizedTensor.from_float(weight, "TensorWiseINT8Layout"), requires_grad=False)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(device)

    @contextlib.contextmanager
    def diverted():
        fallback = DequantizedLinear(layer, dequantizer(QuantizedTensor), may_keep=lambda nbytes, device: True)
        override = AttributeOverride(layer, "forward", fallback.forward)
        try:
            yield
        finally:
            override.remove()

    return (lambda: layer(x),), F.linear(x, layer.weight.dequantize()), diverted


@contextlib.contextmanager
def int8_gemm_missing(device):
    """The device as one without int8 compute: the real thing where ``torch._int_mm`` is missing, otherwise the op
    swapped for one raising the MPS error for the duration (only the doctor, a process of its own, runs this)."""
    if not int8_compute_available(device):
        yield f"{device} has no torch._int_mm"
        return
    real = torch._int_mm

    def missing(*args, **kwargs):
        raise NotImplementedError(MPS_INT_MM_ERROR)

    torch._int_mm = missing
    forget_int8_probes()
    try:
        yield f"simulated on {device}: torch._int_mm raises the MPS error"
    finally:
        torch._int_mm = real
        forget_int8_probes()
