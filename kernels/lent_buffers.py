"""A module's buffers lent to the device its calls compute on, for the duration of those calls, safely across threads.

A module holds one tensor per buffer, so while buffers are swapped for copies on one device the module can serve no
other device. ``LentBuffers`` keeps that straight when calls overlap (a custom node decoding in threads, an API server,
clones sharing modules): calls on the device the buffers are lent to share the copies (the first call lends them, the
last call gives the originals back), and a call on another device waits until they are given back. Without that, the
first call to finish put the originals back under a call still running, which then read a buffer on the wrong device.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .resident_copies import ResidentCopies

# One per module, whoever hooks it: two hook pairs on one module (two injections of a shared model) must agree on
# what is lent, or each would put back the other's originals.
_by_module: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_by_module_lock = threading.Lock()


class LentBuffers:
    """The buffers under one module, swapped for resident copies on one device while calls computing there run."""

    def __init__(self, module: torch.nn.Module):
        # Weakly: this object is the module's value in a weak-keyed table, which a strong reference would keep alive.
        self._slots = [(weakref.ref(owner), name) for owner in module.modules() for name in owner._buffers]
        self._turn = threading.Condition()
        self._device: torch.device | None = None
        self._calls = 0
        self._originals: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        # How many of this thread's calls are inside (a post-hook whose pre-hook never ran, because a pre-hook
        # before it raised, must give nothing back).
        self._inside = threading.local()

    @staticmethod
    def of(module: torch.nn.Module) -> LentBuffers:
        with _by_module_lock:
            lent = _by_module.get(module)
            if lent is None:
                lent = _by_module[module] = LentBuffers(module)
            return lent

    def enter(self, device: torch.device, copies: ResidentCopies) -> None:
        """Start a call computing on ``device``: waits while the buffers are lent to another device."""
        with self._turn:
            while self._calls and self._device != device:
                self._turn.wait()
            self._calls += 1
            self._inside.calls = getattr(self._inside, "calls", 0) + 1
            if self._calls == 1:
                self._device = device
                self._lend(device, copies)

    def leave(self) -> None:
        """End this thread's innermost call; the last call on the device gives the originals back."""
        if not getattr(self._inside, "calls", 0):
            return
        self._inside.calls -= 1
        with self._turn:
            self._calls -= 1
            if not self._calls:
                for owner, name, original in self._originals:
                    owner._buffers[name] = original
                self._originals.clear()
                self._device = None
                self._turn.notify_all()

    def _lend(self, device: torch.device, copies: ResidentCopies) -> None:
        for owner_ref, name in self._slots:
            owner = owner_ref()
            buffer = None if owner is None else owner._buffers.get(name)
            if buffer is not None and buffer.device != device:
                self._originals.append((owner, name, buffer))
                owner._buffers[name] = copies.on((owner, name), buffer, device)
