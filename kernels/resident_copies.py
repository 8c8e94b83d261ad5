"""Copies of small tensors kept on a compute device, made once and reused while the source is unchanged.

A buffer that the model loader left on the offload device would otherwise have to be copied to the compute
device on every call (a host-to-device copy per call). Keeping one copy per (key, device) and handing it out
again removes that copy; a copy is remade only when the source tensor is replaced or modified in place.
"""

from __future__ import annotations

from typing import Hashable

import torch

from .tensor_versions import tensor_versions


class ResidentCopies:
    def __init__(self):
        self._copies: dict[tuple[Hashable, torch.device], tuple[torch.Tensor, tuple, torch.Tensor]] = {}

    def on(self, key: Hashable, source: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``source`` on ``device``: the stored copy while ``source`` is the same, unmodified tensor, else a new one."""
        slot = (key, device)
        entry = self._copies.get(slot)
        version = tensor_versions(source)
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


class FreeCopiesOnRemove:
    """A handle whose ``remove()`` frees the resident copies (on eject, when ComfyUI unloads the model)."""

    def __init__(self, copies: ResidentCopies):
        self.copies = copies

    def remove(self) -> None:
        self.copies.clear()
