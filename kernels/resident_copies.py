"""Copies of small tensors kept on a compute device, made once and reused while the source is unchanged.

A buffer that the model loader left on the offload device would otherwise have to be copied to the compute
device on every call (a host-to-device copy per call). Keeping one copy per (key, device) and handing it out
again removes that copy; a copy is remade only when the source tensor is replaced or modified in place.
"""

from __future__ import annotations

from typing import Hashable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _version(tensor: torch.Tensor) -> int:
    # Inference tensors (ComfyUI builds and moves models under inference_mode) keep no version counter.
    return -1 if tensor.is_inference() else tensor._version


class ResidentCopies:
    def __init__(self):
        self._copies: dict[tuple[Hashable, torch.device], tuple[torch.Tensor, int, torch.Tensor]] = {}

    def on(self, key: Hashable, source: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``source`` on ``device``: the stored copy while ``source`` is the same, unmodified tensor, else a new one."""
        slot = (key, device)
        entry = self._copies.get(slot)
        version = _version(source)
        if entry is not None and entry[0] is source and entry[1] == version:
            return entry[2]
        # The copy outlives the inference_mode block it may be made in; an inference tensor could not be used
        # later where autograd records.
        with torch.inference_mode(False):
            copy = source.to(device)
        self._copies[slot] = (source, version, copy)
        return copy

    def clear(self) -> None:
        self._copies.clear()


class DropCopies:
    """A handle whose ``remove()`` frees the resident copies (on eject, when ComfyUI unloads the model)."""

    def __init__(self, copies: ResidentCopies):
        self.copies = copies

    def remove(self) -> None:
        self.copies.clear()


class HostToDeviceCopies(TorchDispatchMode):
    """Counts, while active, the copies from a CPU tensor to another device (``.to()`` and ``copy_``), keeping
    the source tensors so a caller can tell which were model buffers."""

    def __init__(self):
        super().__init__()
        self.sources: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default:
            source, target = args[0], out
        elif func is torch.ops.aten.copy_.default:
            target, source = args[0], args[1]
        else:
            return out
        if source.device.type == "cpu" and target.device.type != "cpu":
            self.sources.append(source)
        return out

    def __len__(self) -> int:
        return len(self.sources)

    def made_from(self, tensors) -> int:
        """How many of the counted copies were made from one of ``tensors`` (by identity)."""
        wanted = {id(t) for t in tensors}
        return sum(id(source) in wanted for source in self.sources)
