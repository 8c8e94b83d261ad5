"""Device alignment for comfy-kitchen's rope family (``rms_rope*``, ``apply_rope*``).

comfy-kitchen picks a backend per call from the devices of all tensor arguments. One CPU tensor among CUDA ones
fails the fused backends' device check, so the call falls through to the eager backend, which does no device
alignment and raises "Expected all tensors to be on the same device". The activations (``q``/``k``/``x``) decide
where the call runs; the read-only operands (rotation table, RMSNorm scales) are small, so moving a stray one to the
activations' device before routing lets the call reach the fast backend. Activations are never moved: the in-place
variants must write into the caller's tensors.
"""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from typing import Callable

import torch

ROPE_PREFIXES = ("rms_rope", "apply_rope")
ACTIVATIONS = frozenset({"q", "k", "x", "xq", "xk"})
OPERANDS = frozenset({"freqs_cis", "q_scale", "k_scale", "scale"})
# Known by identity: __wrapped__ alone would also unwrap other libraries' functools.wraps wrappers.
_wrappers: weakref.WeakSet = weakref.WeakSet()


def rope_function_names(module) -> list[str]:
    """The public rope functions of a comfy-kitchen module, by name."""
    # __all__ and every other public name: an entry point added without its __all__ line is still a kitchen function
    public = {*getattr(module, "__all__", ()), *(name for name in vars(module) if not name.startswith("_"))}
    return sorted(name for name in public if name.startswith(ROPE_PREFIXES) and callable(getattr(module, name, None)))


@functools.cache  # detection and install both ask, at ComfyUI's start-up
def operand_positions(fn: Callable) -> tuple[str, tuple[tuple[int, str], ...]]:
    """``(anchor, ((index, name), ...))``: the activation that decides the device and where the movable operands sit.

    Raises ValueError when the signature is not the one this alignment was written for (first parameter an
    activation, at least one operand).

    An operand is a known one (``OPERANDS``) or any other parameter annotated as a tensor that is not an activation:
    a scale or table renamed or added by a newer kitchen is read-only like the known ones, and its kernels compute on
    one device, so a stray one fails there as the known ones do. Activations are recognised by name only: moving one
    would make an in-place variant write into a copy.
    """
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].name not in ACTIVATIONS:
        raise ValueError(f"first parameter is {params[0].name if params else 'missing'!r}, "
                         f"expected one of {sorted(ACTIVATIONS)}")
    operands = tuple((index, p.name) for index, p in enumerate(params) if p.name not in ACTIVATIONS and (
        p.name in OPERANDS or _annotated_tensor(p.annotation)))
    if not operands:
        raise ValueError(f"none of {sorted(OPERANDS)} and no other tensor among its parameters")
    return params[0].name, operands


def _annotated_tensor(annotation) -> bool:
    """``torch.Tensor``, ``torch.Tensor | None`` or ``Optional[torch.Tensor]``, as an object or as a string."""
    return annotation is torch.Tensor or re.search(r"\bTensor\b", annotation if isinstance(annotation, str)
                                                   else repr(annotation)) is not None


def device_aligned(fn: Callable, on_align: Callable[[str, str, torch.device, torch.device], None] | None = None):
    """``fn`` with every stray rope operand moved to the device of its first activation before the call.

    When all operands already sit there the wrapper makes the very same call (same objects, nothing copied).
    ``on_align(function_name, operand_name, from_device, to_device)`` is told about each move.
    """
    anchor, operands = operand_positions(fn)

    @functools.wraps(fn)
    def aligned(*args, **kwargs):
        activation = args[0] if args else kwargs.get(anchor)
        if not isinstance(activation, torch.Tensor):
            return fn(*args, **kwargs)
        device = activation.device
        moved_args = None
        for index, name in operands:
            positional = index < len(args)
            value = args[index] if positional else kwargs.get(name)
            if not isinstance(value, torch.Tensor) or value.device == device:
                continue
            if on_align is not None:
                on_align(fn.__name__, name, value.device, device)
            if positional:
                if moved_args is None:
                    moved_args = list(args)
                moved_args[index] = value.to(device)
            else:
                kwargs[name] = value.to(device)
        return fn(*(args if moved_args is None else moved_args), **kwargs)

    _wrappers.add(aligned)
    return aligned


def unaligned(fn: Callable) -> Callable:
    """The function a ``device_aligned`` wrapper wraps, or ``fn`` itself when it is not such a wrapper."""
    return fn.__wrapped__ if fn in _wrappers else fn


def unaligned_kitchen(name: str):
    """``comfy_kitchen.<name>`` as kitchen defines it, past any ``device_aligned`` wrapper installed in this process
    (detection and red controls must reach kitchen itself)."""
    import comfy_kitchen

    return unaligned(getattr(comfy_kitchen, name))


def is_device_mismatch(exc: BaseException) -> bool:
    """The error torch raises when one op mixes devices (CUDA, FakeTensor "cuda", meta and CPU wordings)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("same device" in text or "on the expected device" in text)
