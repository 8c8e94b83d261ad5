"""Whether a tensor was written in place since it was last seen, from its version counters."""

from __future__ import annotations

import torch


def tensor_versions(tensor: torch.Tensor) -> tuple[int, ...]:
    """Version counters of ``tensor`` and, for a wrapper subclass such as a QuantizedTensor, of the tensors it wraps:
    an in-place write (``copy_`` into the int8 payload, a requantize) moves at least one of them. Inference tensors
    (ComfyUI builds and moves models under inference_mode) keep no version counter and read -1."""
    tensors = [tensor]
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = flatten()
        tensors += [getattr(tensor, name) for name in names]
    return tuple(-1 if t.is_inference() else t._version for t in tensors)
