"""comfy_aimdo.model_vbar: per-model VRAM residency on the simulated device.

A slot (``alloc``) is resident while it holds a device tensor of its size. The device's weight budget (``set_budget``,
or the environment's ``BUDGET_MB_ENV``; none: unlimited) is what all vbars of a device may keep resident: the real
library's budget is the card's free VRAM, which on the simulated device would also depend on the activations of the
moment. ``fault`` makes the slots of a range resident within the budget, evicting unpinned slots of other vbars
(least recently prioritized first) if it must; if that is not enough it answers None (comfy-aimdo's VBAR_FAULT_OOM:
ComfyUI streams the weight instead). A signature is the generation of each slot in the range: a slot evicted and
faulted in again has a new one, so ComfyUI sees that its copy is gone.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref

import torch

BUDGET_MB_ENV = "MINIMAX_HOTFIX_SIMULATED_VBAR_MB"
ALIGNMENT = 512

_lock = threading.RLock()
_vbars: weakref.WeakSet = weakref.WeakSet()
_priority = itertools.count(1)
_generation = itertools.count(1)
_budget_bytes: int | None = None if os.environ.get(BUDGET_MB_ENV) is None else int(
    float(os.environ[BUDGET_MB_ENV]) * 2**20)
_counters = {"faulted_in": [0, 0], "resident": [0, 0], "out_of_vram": [0, 0]}  # [count, bytes] since reset


def set_budget(mb: float | None) -> None:
    global _budget_bytes
    _budget_bytes = None if mb is None else int(mb * 2**20)


def reset_counters() -> None:
    with _lock:
        for entry in _counters.values():
            entry[:] = [0, 0]


def stats() -> dict:
    """The budget, the bytes resident per device, and the faults since ``reset_counters``: slots faulted in (their
    weights copied to the device), already resident, refused (out of VRAM)."""
    with _lock:
        devices = sorted({vbar.device for vbar in all_vbars()})
        return {"budget_bytes": _budget_bytes, "counters": {name: list(entry) for name, entry in _counters.items()},
                "resident_bytes": {device: resident_bytes(device) for device in devices}}


def count(name: str, nbytes: int) -> None:
    _counters[name][0] += 1
    _counters[name][1] += nbytes


def all_vbars(device: int | None = None) -> list[ModelVBAR]:
    return [vbar for vbar in list(_vbars) if device is None or vbar.device == device]


def resident_bytes(device: int) -> int:
    return sum(vbar.loaded_size() for vbar in all_vbars(device))


def room(device: int) -> float:
    return float("inf") if _budget_bytes is None else _budget_bytes - resident_bytes(device)


class Slot:
    __slots__ = ("size", "tensor", "generation", "pins")

    def __init__(self, size: int):
        self.size, self.tensor, self.generation, self.pins = size, None, 0, 0


class ModelVBAR:
    def __init__(self, size, device):
        self.device, self.max_size, self.offset = device, size, 0
        self.base_addr = 0
        self.slots: dict[int, Slot] = {}
        self.priority = 0
        with _lock:
            _vbars.add(self)

    def prioritize(self, malloc_async_clamp=None):
        self.priority = next(_priority)

    def deprioritize(self):
        self.priority = 0

    def alloc(self, num_bytes):
        self.offset = (self.offset + ALIGNMENT - 1) & ~(ALIGNMENT - 1)
        if self.offset + num_bytes > self.max_size:
            raise MemoryError("VBAR OOM")
        alloc = self.base_addr + self.offset
        self.slots[alloc] = Slot(num_bytes)
        self.offset += num_bytes
        return (self, alloc, num_bytes)

    def slots_in(self, alloc: int, size: int) -> list[Slot]:
        return [slot for start, slot in self.slots.items() if start < alloc + size and alloc < start + slot.size]

    def fault(self, alloc, size):
        with _lock:
            slots = self.slots_in(alloc, size)
            needed = sum(slot.size for slot in slots if slot.tensor is None)
            if needed and not make_room(self.device, needed, spare=self):
                count("out_of_vram", needed)
                return None
            for slot in slots:
                if slot.tensor is None:
                    slot.tensor = torch.empty(slot.size, dtype=torch.uint8, device=f"npu:{self.device}")
                    slot.generation = next(_generation)
                    count("faulted_in", slot.size)
                else:
                    count("resident", slot.size)
                slot.pins += 1
            return tuple(slot.generation for slot in slots)

    def unpin(self, alloc, size):
        with _lock:
            for slot in self.slots_in(alloc, size):
                slot.pins = max(slot.pins - 1, 0)

    def tensor(self, alloc, size) -> torch.Tensor:
        slot = self.slots[alloc]
        assert slot.tensor is not None and slot.size == size, "aimdo_to_tensor of a slot that is not resident"
        return slot.tensor

    def loaded_size(self) -> int:
        return sum(slot.size for slot in self.slots.values() if slot.tensor is not None)

    def free_memory(self, size_bytes) -> int:
        """Evicts this vbar's unpinned slots until ``size_bytes`` are freed; returns the bytes freed."""
        with _lock:
            return evict(self, int(size_bytes))

    def set_watermark_limit(self, size_bytes):
        pass

    def set_watermark(self, size_bytes):
        pass

    def get_nr_pages(self) -> int:
        """A page is one slot here (the real library's are 32 MB)."""
        return len(self.slots)

    def get_watermark(self) -> int:
        return self.loaded_size()

    def get_residency(self):
        return [int(slot.tensor is not None) | (2 * (slot.pins > 0)) for slot in self.slots.values()]


def evict(vbar: ModelVBAR, wanted: int) -> int:
    freed = 0
    for slot in vbar.slots.values():
        if freed >= wanted:
            break
        if slot.tensor is not None and not slot.pins:
            slot.tensor = None
            freed += slot.size
    return freed


def make_room(device: int, needed: int, spare: ModelVBAR) -> bool:
    """Whether ``needed`` bytes fit in ``device``'s budget, after evicting other vbars' slots if they do not."""
    for vbar in sorted((vbar for vbar in all_vbars(device) if vbar is not spare), key=lambda vbar: vbar.priority):
        missing = needed - room(device)
        if missing <= 0:
            break
        evict(vbar, int(missing))
    return room(device) >= needed


def vbar_fault(alloc):
    vbar, offset, size = alloc
    return vbar.fault(offset, size)


def vbar_unpin(alloc):
    if alloc is not None:
        vbar, offset, size = alloc
        vbar.unpin(offset, size)


def vbar_signature_compare(a, b):
    if a is None or b is None:
        return False
    if len(a) != len(b):
        raise ValueError(f"Signatures of mismatched length {len(a)} != {len(b)}")
    return tuple(a) == tuple(b)


def vbars_reset_watermark_limits():
    pass


def vbars_analyze(device=None) -> int:
    """The bytes that eviction could give back on ``device`` (the first device when None)."""
    device = 0 if device is None else device
    with _lock:
        return sum(slot.size for vbar in all_vbars(device) for slot in vbar.slots.values()
                   if slot.tensor is not None and not slot.pins)
