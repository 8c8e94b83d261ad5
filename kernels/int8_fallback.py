"""Tensor helpers for running int8-weight linears on devices without an int8 GEMM (``torch._int_mm``).

* ``int8_compute_available(device)``: whether ``torch._int_mm`` runs on that device, found by running it once on
  tiny tensors there (cached per device). Asking by device name would be wrong: MPS gained ``_int_mm`` in
  torch 2.15, and a build may lack it on any backend.
* ``DequantizedWeightCache``: one layer's dequantized weight, kept while the weight is unchanged, so the fallback
  does not dequantize on every call.
* ``DequantizedLinear``: a layer's replacement ``forward``: the layer's own (fused int8) forward where the input's
  device has int8 compute, ``F.linear`` with the cached dequantized weight where it has not.

No ComfyUI imports here.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch
import torch.nn.functional as F

# CUDA's _int_mm wants more than 16 rows and inner/outer sizes that are multiples of 8; 32 satisfies every backend.
_PROBE_SIZE = 32

_probe_lock = threading.Lock()
_int8_compute: dict[torch.device, bool] = {}


def int8_compute_available(device) -> bool:
    """Whether ``torch._int_mm`` runs on ``device`` and returns the right numbers (probed once per device)."""
    found = _int8_compute.get(device)  # every diverted call asks with x.device: skip normalizing on a hit
    if found is None:
        device = torch.device(device)
        with _probe_lock:
            found = _int8_compute.get(device)
            if found is None:
                found = _int8_compute[device] = _probe_int_mm(device)
    return found


def forget_int8_probes() -> None:
    """Make the next ``int8_compute_available`` call probe again (tests; a doctor run that simulates a device)."""
    with _probe_lock:
        _int8_compute.clear()


def _probe_int_mm(device: torch.device) -> bool:
    try:
        ones = torch.ones(_PROBE_SIZE, _PROBE_SIZE, dtype=torch.int8, device=device)
        return bool((torch._int_mm(ones, ones) == _PROBE_SIZE).all())
    # MPS before torch 2.15 raises NotImplementedError; a missing kernel elsewhere, or a device without data
    # (meta) when the result is read, raises RuntimeError
    except (NotImplementedError, RuntimeError):
        return False


def _versions(tensor: torch.Tensor) -> tuple[int, ...]:
    """Version counters of ``tensor`` and, for a wrapper subclass such as a QuantizedTensor, of the tensors it wraps:
    an in-place write (``copy_`` into the int8 payload, a requantize) moves at least one of them."""
    counters = [tensor._version]
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = flatten()
        counters += [getattr(tensor, name)._version for name in names]
    return tuple(counters)


class DequantizedWeightCache:
    """One layer's weight, dequantized to the compute dtype, kept until ComfyUI changes the weight.

    ComfyUI moves a weight or patches in a LoRA by installing a new Parameter (a different object) and writes in
    place through the tensors' version counters, so the entry is valid while the weight is the same object with the
    same versions on the same device, in the same dtype. One entry per layer: a layer computes on one device in one
    dtype, and a stale copy must not linger next to a fresh one.

    ``may_keep(nbytes, device)`` decides whether a fresh copy may stay resident; when it says no, the copy is used
    for this call only (dequantized again next call) so a tight device is not pushed out of memory.
    """

    def __init__(self, dequantize: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
                 may_keep: Callable[[int, torch.device], bool]):
        self._dequantize = dequantize
        self._may_keep = may_keep
        self._source: weakref.ref | None = None
        self._stamp: tuple | None = None
        self._weight: torch.Tensor | None = None

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        stamp = (weight.device, dtype, _versions(weight))
        if self._weight is not None and self._source() is weight and self._stamp == stamp:
            return self._weight
        self.clear()  # free the stale copy before making the new one
        fresh = self._dequantize(weight, dtype)
        if self._may_keep(fresh.numel() * fresh.element_size(), weight.device):
            self._source, self._stamp, self._weight = weakref.ref(weight), stamp, fresh
        return fresh

    def clear(self) -> None:
        self._source = self._stamp = self._weight = None

    @property
    def nbytes(self) -> int:
        return 0 if self._weight is None else self._weight.numel() * self._weight.element_size()


def dequantizer(quantized_tensor: type) -> Callable[[torch.Tensor, torch.dtype], torch.Tensor]:
    """``dequantize(weight, dtype)``: a ``quantized_tensor`` weight dequantized to ``dtype``, any other weight cast."""

    def dequantize(weight, dtype):
        weight = weight.to(dtype=dtype)  # a QuantizedTensor only retags its output dtype here
        return weight.dequantize() if isinstance(weight, quantized_tensor) else weight

    return dequantize


class DequantizedLinear:
    """A replacement ``forward`` for one linear layer with an int8 weight: the layer's own forward (its fused int8
    kernel) where the input's device has int8 compute, else ``F.linear`` with the weight dequantized and cached.

    The device is checked on every call rather than once: the same model may compute on a device with the op and,
    after a move, on one without it."""

    def __init__(self, layer, dequantize: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
                 may_keep: Callable[[int, torch.device], bool]):
        self.layer = layer
        self.native_forward = layer.forward
        self.dequantize = dequantize
        self.weights = DequantizedWeightCache(dequantize, may_keep)

    def forward(self, x, *args, **kwargs):
        if int8_compute_available(x.device):
            return self.native_forward(x, *args, **kwargs)
        return self.linear(x)

    def linear(self, x):
        return self.dequantized_linear(x, self.layer.weight, self.layer.bias)

    def dequantized_linear(self, x, weight, bias):
        """``weight`` and ``bias`` already on ``x``'s device."""
        return F.linear(x, self.weights.get(weight, x.dtype), None if bias is None else bias.to(x.dtype))
