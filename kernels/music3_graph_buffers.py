"""Static buffers for CUDA-graph replay.

A captured CUDA graph keeps the device addresses its kernels read at capture time. A decode loop that hands the
graphed layers a freshly allocated hidden state every step therefore makes each replay read the first step's
(freed, then reused) memory. The cure is to feed every step through the same storage: ``StaticBufferPool`` keeps one
allocation per name for as long as its key (shape, stride, dtype, device) stays the same, and reallocates only when
the key changes. ``with_decode_buffers`` uses it to give a Llama-style ``forward(..., decode_buffers=None)`` the
buffers its caller forgot to pass.
"""

from __future__ import annotations

import functools
from typing import Callable, Hashable

import torch


def tensor_key(tensor: torch.Tensor) -> tuple:
    """What a graph depends on besides the data: (shape, stride, dtype, device)."""
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device


class StaticBufferPool:
    """Named allocations that survive across decode steps; a name is reallocated only when its key changes."""

    def __init__(self):
        self._slots: dict[str, tuple[Hashable, object]] = {}

    def reserve(self, name: str, key: Hashable, allocate: Callable[[], object]):
        """The value stored under ``name``; ``allocate()`` runs only the first time and when ``key`` differs."""
        slot = self._slots.get(name)
        if slot is None or slot[0] != key:
            slot = (key, allocate())
            self._slots[name] = slot
        return slot[1]

    def clear(self) -> None:
        self._slots.clear()


def is_graphed_decode_step(module, embeds, past_key_values) -> bool:
    """The forward calls that can run as graph replays: single-token decode steps of a graph-enabled decoder."""
    return (
        bool(getattr(module, "graph_dynamic_vbar_blocks", False))
        and isinstance(embeds, torch.Tensor)
        and embeds.ndim == 3
        and embeds.shape[1] == 1
        and bool(past_key_values)
    )


def with_decode_buffers(module, forward: Callable, pool: StaticBufferPool, graphs_disabled: Callable[[], bool]):
    """``forward`` that passes pooled ``decode_buffers`` on graphed decode steps whose caller passed none.

    The buffers come from ``module.init_decode_buffers(batch, device, dtype)`` (the decoder's own layout) and are
    keyed by the hidden state's geometry, so a whole AR run reuses one allocation. A caller that passes its own
    buffers, a prefill, or graphs switched off (``graphs_disabled()``) goes straight through unchanged.
    """

    @functools.wraps(forward)
    def forward_with_decode_buffers(*args, decode_buffers=None, **kwargs):
        embeds = kwargs.get("embeds")
        if (
            decode_buffers is None
            and is_graphed_decode_step(module, embeds, kwargs.get("past_key_values"))
            and not graphs_disabled()
        ):
            decode_buffers = pool.reserve(
                "decode",
                tensor_key(embeds),
                lambda: module.init_decode_buffers(embeds.shape[0], embeds.device, embeds.dtype),
            )
        return forward(*args, decode_buffers=decode_buffers, **kwargs)

    return forward_with_decode_buffers
