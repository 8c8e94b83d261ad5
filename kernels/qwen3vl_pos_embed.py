"""Tensor helpers for the Qwen3-VL vision pos-embed fixes (``patches/qwen3vl_pos_embed.py`` for ComfyUI's tower,
``patches/transformers_qwen3vl_pos_embed.py`` for transformers'). Pure torch: no ComfyUI or transformers imports.

* ``track_compute_device`` / ``compute_device``: the device a module computes on, recorded per call. It lives in a
  ContextVar frame that the module's own forward opens and closes, so two jobs in two threads (each thread has its
  own context) never see each other's device, and nothing is stored on the shared module. ``computing_on`` opens
  such a frame by hand (self-tests, benchmarks, tests).
* ``interpolated_position_table``: the bilinear resampling of the square learned position table to each image's
  patch grid (``grid_shapes`` reads that from a ``grid_thw`` tensor), computed on a device the caller chooses,
  with the same float operations as the towers' own method.
* ``ResidentPositionTables``: what one tower keeps on its compute devices between calls so that the position table
  crosses the bus at most once (the whole table, or one image size's interpolated rows, whichever is smaller).
* ``gather_rows``: an embedding lookup whose weight lives on another device than its result is needed on.
* ``rotary_frequency_table``: the vision rotary table (position x inverse frequency), on the inverse frequencies'
  device (``patches/qwen3vl_rotary_table.py`` hands it a copy on the compute device).
* ``tiny_qwen3vl_tower``: a random tiny ComfyUI tower from the class and ops the caller hands in, which both ComfyUI
  Qwen3-VL fixes' detection runs (``diagnostics/tiny_qwen3vl.py`` binds it to ComfyUI for self-tests and tests).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import OrderedDict
from typing import Callable, Hashable, Sequence

import torch

_calls: contextvars.ContextVar[tuple] = contextvars.ContextVar("minimax_hotfix_qwen3vl_calls", default=())


class _Call:
    """One forward call of one module in the current thread: the device its activations are on."""

    __slots__ = ("owner", "device")

    def __init__(self, owner, device: torch.device | None):
        self.owner, self.device = owner, device


def _current_call(owner) -> _Call | None:
    for call in reversed(_calls.get()):
        if call.owner is owner:
            return call
    return None


def compute_device(owner) -> torch.device | None:
    """The device ``owner``'s forward call in progress in this thread computes on; None outside such a call."""
    call = _current_call(owner)
    return None if call is None else call.device


def _open_call(owner, device: torch.device | None) -> None:
    _calls.set(_calls.get() + (_Call(owner, device),))


def _close_call(owner) -> None:
    calls = _calls.get()
    for i in range(len(calls) - 1, -1, -1):
        if calls[i].owner is owner:
            _calls.set(calls[:i] + calls[i + 1:])
            return


@contextlib.contextmanager
def computing_on(owner, device: torch.device):
    """``compute_device(owner)`` answers ``device`` inside this block (what ``owner``'s tracked forward does)."""
    _open_call(owner, device)
    try:
        yield
    finally:
        _close_call(owner)


def track_compute_device(module: torch.nn.Module, input_name: str, refine_from: torch.nn.Module | None = None) -> list:
    """Hooks that make ``compute_device(module)`` answer during each of ``module``'s forward calls.

    The device is the one of the forward's first input (positional, or the keyword ``input_name``; None if the
    call passes neither, and then the patched code keeps its stock behaviour). When ``refine_from`` is given (the
    submodule whose output the position table is added to), its output's device replaces it: an offload hook that
    moves the inputs inside ``module.forward`` then cannot mislead us. Returns the torch hook handles.
    """

    def open_call(mod, args, kwargs):
        first = args[0] if args else kwargs.get(input_name)
        _open_call(mod, first.device if isinstance(first, torch.Tensor) else None)

    def close_call(mod, args, kwargs, output):
        _close_call(mod)

    handles = [
        module.register_forward_pre_hook(open_call, with_kwargs=True),
        module.register_forward_hook(close_call, with_kwargs=True, always_call=True),
    ]
    if refine_from is not None:

        def refine(sub, args, output):
            call = _current_call(module)
            if call is not None and isinstance(output, torch.Tensor):
                call.device = output.device

        handles.append(refine_from.register_forward_hook(refine))
    return handles


def grid_shapes(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    """``grid_thw``'s rows as ``(t, h, w)`` ints, the form ``interpolated_position_table`` takes."""
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def interpolated_position_table(
    lookup: Callable[[torch.Tensor], torch.Tensor],
    grid: Sequence[tuple[int, int, int]],
    num_grid_per_side: int,
    merge_size: int,
    table_dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The per-patch position embeddings for images/videos of ``grid`` = [(t, h, w), ...] (in patches), built on
    ``device`` from the learned ``num_grid_per_side``² table that ``lookup`` (the embedding module) gathers from.

    Each patch gets the bilinear mix (align-corners) of its 4 neighbouring table rows; the rows come out in the
    spatial-merge block order the vision blocks expect, repeated over the t frames. Float operations and their
    order match the towers' ``fast_pos_embed_interpolate`` (weights in float32, rounded once to ``table_dtype``,
    taps summed left to right), so the result is bit-identical to theirs on the same device.
    """
    side = num_grid_per_side
    tap_indices, tap_weights = [], []
    for _, h, w in grid:
        rows = torch.linspace(0, side - 1, h, device=device)
        cols = torch.linspace(0, side - 1, w, device=device)
        row_lo, col_lo = rows.int(), cols.int()
        row_hi, col_hi = (row_lo + 1).clip(max=side - 1), (col_lo + 1).clip(max=side - 1)
        row_frac, col_frac = rows - row_lo, cols - col_lo
        row_pairs = ((row_lo * side, 1 - row_frac), (row_hi * side, row_frac))
        col_pairs = ((col_lo, 1 - col_frac), (col_hi, col_frac))
        tap_indices.append(torch.stack([
            (r[:, None] + c[None, :]).flatten() for r, _ in row_pairs for c, _ in col_pairs
        ]))
        tap_weights.append(torch.stack([
            (rw[:, None] * cw[None, :]).flatten() for _, rw in row_pairs for _, cw in col_pairs
        ]))
    indices = torch.cat(tap_indices, dim=1).long()
    weights = torch.cat(tap_weights, dim=1).to(table_dtype)
    taps = lookup(indices).to(device) * weights[:, :, None]
    per_patch = taps[0] + taps[1] + taps[2] + taps[3]

    m = merge_size
    blocks = []
    for image, (t, h, w) in zip(per_patch.split([h * w for _, h, w in grid]), grid, strict=True):
        frames = image.repeat(t, 1).view(t, h // m, m, w // m, m, -1)
        blocks.append(frames.permute(0, 1, 3, 2, 4, 5).flatten(0, 4))
    return torch.cat(blocks)


class ResidentPositionTables:
    """One tower's position tables kept on compute devices, so that per call nothing of the table crosses the bus
    once it has crossed, and no call sends more than the stock method (its N x hidden result) would.

    * A call with at least as many patches as the learned table has rows makes the whole table resident on the
      compute device (one cast, no larger than the stock result) and interpolates there; later calls, whatever their
      image sizes, move nothing.
    * A smaller call, while no table is resident, lets the stock method interpolate where the weight is and keeps its
      result on the compute device for that grid: the bytes of the stock call, once per image size. The kept results
      never hold more rows than the table itself (oldest dropped first).

    Everything is dropped when ``stamp`` changes (the weight replaced, written in place, or patched differently) and
    by ``clear`` (the model unloaded); ``drop(device)`` frees one device's share. Values are the stock ones: kept
    results are the stock method's output, and a resident table is the rows the tower's own ``pos_embed`` op returns,
    gathered exactly.

    Calls in several threads (one tower, jobs on two threads or devices) build one at a time: a table built from the
    weight as it was when its build started must not be kept under a newer call's stamp, and a table being built is
    not sent a second time.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._stamp: Hashable = None
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._results: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def clear(self) -> None:
        with self._lock:
            self._forget()

    def drop(self, device: torch.device) -> None:
        """Free what is kept on ``device`` (the weight itself is there now), leaving the other devices' tables."""
        with self._lock:
            self._tables.pop(device, None)
            for key in [key for key in self._results if key[0] == device]:
                del self._results[key]

    def _forget(self) -> None:
        self._stamp = None
        self._tables.clear()
        self._results.clear()

    def resident_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for t in (*self._tables.values(), *self._results.values()))

    def table(
        self,
        stamp: Hashable,
        device: torch.device,
        grid: Sequence[tuple[int, int, int]],
        table_rows: int,
        whole_table: Callable[[], torch.Tensor],
        stock_result: Callable[[], torch.Tensor],
        interpolate: Callable[[Callable[[torch.Tensor], torch.Tensor]], torch.Tensor],
    ) -> torch.Tensor:
        """The position table for ``grid`` on ``device``.

        ``whole_table()``: the ``table_rows`` learned rows on ``device``; ``stock_result()``: the stock method's result
        (wherever it computes); ``interpolate(lookup)``: the interpolation on ``device`` gathering through ``lookup``.
        """
        with self._lock:
            if stamp != self._stamp:
                self._forget()
                self._stamp = stamp
            table = self._tables.get(device)
            if table is None and sum(t * h * w for t, h, w in grid) >= table_rows:
                table = self._tables[device] = _outside_inference(whole_table)
                for key in [key for key in self._results if key[0] == device]:
                    del self._results[key]
            if table is None:
                key = (device, tuple(grid))
                result = self._results.get(key)
                if result is None:
                    result = self._results[key] = _outside_inference(lambda: stock_result().to(device))
                    while sum(len(kept) for kept in self._results.values()) > table_rows:
                        self._results.popitem(last=False)
                self._results.move_to_end(key)
                return result
        return interpolate(lambda indices: table[indices])


def _outside_inference(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    # A kept tensor outlives the inference_mode block it may be made in; an inference tensor could not be used later
    # where autograd records.
    with torch.inference_mode(False), torch.no_grad():
        return make()


def gather_rows(
    lookup: Callable[[torch.Tensor], torch.Tensor],
    indices: torch.Tensor,
    table_rows: int,
    gather_device: torch.device,
    out_device: torch.device,
) -> torch.Tensor:
    """``lookup(indices)`` run where the table lives (``gather_device``), returned on ``out_device``.

    What crosses between the devices is whichever is smaller: the gathered rows, or the whole table (then
    indexed on ``out_device``). Both give the same values: a lookup copies rows exactly.
    """
    if gather_device == out_device:
        return lookup(indices.to(gather_device))
    if indices.numel() > table_rows:
        table = lookup(torch.arange(table_rows, device=gather_device)).to(out_device)
        return table[indices.to(out_device)]
    return lookup(indices.to(gather_device)).to(out_device)


def rotary_frequency_table(inv_freq: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Positions ``0..seqlen-1`` times ``inv_freq`` (seqlen x len(inv_freq)) on ``inv_freq``'s device, with the
    float operations of ComfyUI's ``Qwen35VisionRotaryEmbedding.forward``, so bit-identical to it on one device."""
    positions = torch.arange(seqlen, device=inv_freq.device, dtype=inv_freq.dtype)
    return torch.outer(positions, inv_freq)


def hook_comfy_towers(model: torch.nn.Module, tower_class: type, hook: Callable[[torch.nn.Module], object]) -> list:
    """For each ``tower_class`` (a ComfyUI vision tower: it takes ``x`` and adds its tables to ``patch_embed``'s output)
    in ``model``: ``track_compute_device``'s handles and ``hook(tower)``'s handle."""
    handles = []
    for module in model.modules():
        if isinstance(module, tower_class):
            handles += track_compute_device(module, "x", refine_from=module.patch_embed)
            handles.append(hook(module))
    return handles


TINY_QWEN3VL_TOWER = dict(spatial_merge_size=2, patch_size=4, hidden_size=32, num_heads=2, num_position_embeddings=64,
                          temporal_patch_size=2, in_channels=3, intermediate_size=48, depth=1, out_hidden_size=40)
TINY_QWEN3VL_GRID = ((1, 4, 6), (2, 2, 2), (1, 10, 14))


def tiny_qwen3vl_tower(vision_model_class: type, ops, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random tiny ``vision_model_class`` (ComfyUI's ``Qwen3VLVisionModel``) on the CPU with ``ops``; the same
    weights whatever the ops (its own generator: the global random state is left alone).

    The weights go in through ``load_state_dict``, as ComfyUI loads a model: under dynamic VRAM ComfyUI's ops build
    their layers without weights (``Linear.weight is None``, materialized from the state dict) or on ``meta``, so
    setting ``parameter.data`` fails there ("incompatible tensor type"). The state dict comes from the same tower built
    with torch's own layers."""
    generator = torch.Generator().manual_seed(0)
    config = {**TINY_QWEN3VL_TOWER, "deepstack_visual_indexes": [0]}
    with torch.random.fork_rng(devices=[]):  # torch's layers draw their initial weights from the global generator
        weights = vision_model_class(config, dtype=dtype, ops=torch.nn)
    with torch.no_grad():
        for parameter in weights.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator).mul_(0.1))
    tower = vision_model_class(config, dtype=dtype, ops=ops)
    tower.load_state_dict(weights.state_dict())
    return tower
