"""Fix ``qwen3vl_pos_embed``: ComfyUI's Qwen3-VL / Qwen3.5 vision tower interpolates its position table on the CPU
whenever ``pos_embed``'s weight sits in CPU RAM.

Bug: ``comfy/text_encoders/qwen35.py`` ``Qwen35VisionModel.fast_pos_embed_interpolate`` (used by the MiniMax H3
text encoder's ``Qwen3VLVisionModel``) takes its device from ``self.pos_embed.weight.device`` and builds the tap
indices, the 4-tap gather and the weighted sum there; ``forward`` then moves the result to the activations'
device. With stock ops that is no crash (the seed's "cuda:0 and cpu" crash is transformers', see
``transformers_qwen3vl_pos_embed``), but the weight sits in CPU RAM in two common cases, and then every image runs
the whole interpolation on the CPU and ships its N x hidden result over the bus:
  * dynamic VRAM (comfy-aimdo, the default on NVIDIA): the weight stays the memory-mapped CPU tensor and the GPU copy
    lives in the vbar, so the interpolation always runs on the CPU, and ``comfy.ops.cast_bias_weight`` (CPU input
    on a vbar module) also clones the whole table on every call;
  * lowvram partial loading with ``pos_embed`` among the offloaded weights.
Measured on 2 CPU cores (benchmarks/qwen3vl_pos_embed.py): ~0.1-0.2 s per 1024x1024 reference image, against a GPU
vision tower that needs milliseconds. The fix keeps the table on the compute device, per tower, so that it crosses
the bus at most once and no call sends more than stock: an image with at least as many patches as the table has rows
makes the whole table resident (one cast through the tower's own ``pos_embed`` op, LoRA/lowvram patches included)
and every later call interpolates there moving nothing; a smaller image, while no table is resident, keeps the stock
result for its size on the device (stock's bytes, once per size). Kept across ComfyUI's eject/inject around each
load and the detach without unpatching that precedes every reload; rebuilt when the weight or its patches change;
freed when ComfyUI unloads the model (a detach callback that unpatches).
Upstream: no ComfyUI issue or PR (unchanged in Comfy-Org/ComfyUI at 06990860). Same anti-pattern:
verl-project/verl#5571, invoke-ai/InvokeAI#9373.
Applies to: ComfyUI with ``comfy/text_encoders/qwen35.py`` (0.33.0 checked), any text encoder holding that tower.
Already fixed upstream when ``fast_pos_embed_interpolate`` no longer takes its device from ``pos_embed.weight``;
failed (left off) when the method or its call in ``forward`` is gone (a renamed one that ``forward`` calls and that reads
``pos_embed.weight``'s device is found by that), or when its result no longer equals the pack's compute-device copy on
a tiny CPU tower (checked once, in ``detect``).
The rotary table (``rot_pos_emb``, built on the ``inv_freq`` buffer's device) is ``qwen3vl_rotary_table``'s.
Off switch: ``MINIMAX_HOTFIX_DISABLE=qwen3vl_pos_embed``.
"""

from __future__ import annotations

import inspect
import re
import threading
import weakref

import torch

from ..contract import AttributeOverride, Fix, Retirement, State, Status, Target
from ..contract.comfy import qwen3vl_tower_class
from ..kernels.qwen3vl_pos_embed import (
    TINY_QWEN3VL_GRID,
    ResidentPositionTables,
    compute_device,
    grid_shapes,
    hook_comfy_towers,
    interpolated_position_table,
    tiny_qwen3vl_tower,
)
from ..kernels.tensor_versions import tensor_versions

_READS_WEIGHT_DEVICE = re.compile(r"device\s*=\s*self\.pos_embed\.weight\.device")

def _casts_weight(embedding) -> bool:
    """Whether this ComfyUI Embedding op brings its weight to its input's device (the stock ops and GGUF's do)."""
    return bool(getattr(embedding, "comfy_cast_weights", False) or getattr(embedding, "weight_function", None)
                or getattr(embedding, "bias_function", None))


def _weight_stamp(model, embedding) -> tuple:
    """What the table's values depend on: the weight object, its in-place writes, the patches ComfyUI applied to the
    model (LoRA: a new uuid) and the functions a lowvram load runs on the weight at each cast (remade per load, so
    compared by kind and key)."""
    weight = embedding.weight
    functions = [*getattr(embedding, "weight_function", ()), *getattr(embedding, "bias_function", ())]
    return (id(weight), tensor_versions(weight), weight.dtype, getattr(model, "current_weight_patches_uuid", None),
            tuple((type(f), getattr(f, "key", None) or id(f)) for f in functions))


def _table_on_compute_device(model, tower, stock):
    """``tower.fast_pos_embed_interpolate``, with the table made on, and kept on, the device the call computes on."""

    def fast_pos_embed_interpolate(grid_thw, *newer, **newer_keywords):
        device = compute_device(tower)
        embedding = tower.pos_embed
        if device is None or not _casts_weight(embedding) or newer or newer_keywords:
            # arguments a newer core added (a device, say): its own method knows what they mean, the table does not
            return stock(grid_thw, *newer, **newer_keywords)
        tables = FIX.resident_tables(tower)
        if embedding.weight.device == device:
            # The weight itself is there now: a copy there would only hold memory. Another device's table stays: the
            # same tower may compute there too (weights cast per call), in another job at the same time.
            tables.drop(device)
            return stock(grid_thw)
        grid, rows = grid_shapes(grid_thw), embedding.num_embeddings
        return tables.table(
            _weight_stamp(model, embedding), device, grid, rows,
            whole_table=lambda: embedding(torch.arange(rows, device=device)),
            stock_result=lambda: stock(grid_thw),
            interpolate=lambda lookup: interpolated_position_table(
                lookup, grid, tower.num_grid_per_side, tower.spatial_merge_size, embedding.weight.dtype, device))

    return fast_pos_embed_interpolate


def hook_towers(model: torch.nn.Module) -> list:
    """Attach the fix to every ComfyUI Qwen3.5/Qwen3-VL vision tower in ``model``; returns removable handles."""
    tower_class = qwen3vl_tower_class()
    if tower_class is None:
        return []
    name = position_table_method(tower_class)
    if name is None:
        return []
    return hook_comfy_towers(model, tower_class, lambda tower: AttributeOverride(
        tower, name, _table_on_compute_device(model, tower, getattr(tower, name))))


def position_table_method(tower_class) -> str | None:
    """The method ``forward`` calls to build the position table: ``fast_pos_embed_interpolate``, or on a core that
    renamed it the one method ``forward`` calls that takes its device from ``pos_embed.weight``."""
    called = inspect.unwrap(tower_class.forward).__code__.co_names
    if "fast_pos_embed_interpolate" in vars(tower_class) and "fast_pos_embed_interpolate" in called:
        return "fast_pos_embed_interpolate"
    found = [name for name, method in vars(tower_class).items() if name in called and inspect.isfunction(method)
             and _READS_WEIGHT_DEVICE.search(inspect.getsource(method))]
    return found[0] if len(found) == 1 else None


def _on_detach(patcher, unpatch_all=True) -> None:
    # ComfyUI frees a model's device memory through detach(unpatch_all=True) (model_unload). It also detaches with
    # unpatch_all=False, leaving the weights where they are: load_models_gpu pops and detaches a loaded model (and
    # its clones) before loading it again, on every prompt; a patcher being garbage-collected detaches too. The
    # towers and their weights stay, so must the tables (dropping them there resent the whole table on every
    # prompt); the stamp still guards their values.
    if unpatch_all:
        FIX.drop_resident_tables(patcher.model)


def _on_detach_event():
    try:
        from comfy.patcher_extension import CallbacksMP
    except ImportError:
        return None
    return getattr(CallbacksMP, "ON_DETACH", None)


class Qwen3VLPosEmbedFix(Fix):
    id = "qwen3vl_pos_embed"
    targets = (Target.CLIP,)
    retirement = Retirement(
        fixed_by="none yet: a core whose Qwen35VisionModel.fast_pos_embed_interpolate builds the table on the "
                 "activations' device",
        delete_when="every supported core reads 'fixed upstream' here (fast_pos_embed_interpolate no longer takes its "
                    "device from pos_embed.weight)")

    def __init__(self):
        self._lock = threading.Lock()
        # Per tower (weakly: a deleted text encoder takes its tables along); kept across ComfyUI's eject/inject around
        # every load, which would otherwise resend the table on every prompt; dropped when the model is unloaded.
        self._resident: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def resident_tables(self, tower) -> ResidentPositionTables:
        """What ``tower`` keeps on its compute devices between calls (``kernels/qwen3vl_pos_embed.py``)."""
        with self._lock:  # two jobs' first calls on one tower must share one set of tables
            return self._resident.setdefault(tower, ResidentPositionTables())

    def drop_resident_tables(self, model: torch.nn.Module) -> None:
        """Free the tables of every tower in ``model`` (ComfyUI unloaded it, or the fix is detached)."""
        with self._lock:
            kept = [self._resident.get(module) for module in model.modules()]
        for tables in kept:
            if tables is not None:
                tables.clear()

    def detect(self) -> Status:
        tower_class = qwen3vl_tower_class()
        if tower_class is None:
            return Status(State.NOT_APPLICABLE, "no ComfyUI Qwen3.5/Qwen3-VL vision tower "
                                                "(comfy.text_encoders.qwen35.Qwen35VisionModel) in this process")
        name = position_table_method(tower_class)
        if name is None:
            return Status(State.FAILED, "Qwen35VisionModel no longer builds its position table in "
                                          "fast_pos_embed_interpolate: target drifted, fix left off")
        if not _READS_WEIGHT_DEVICE.search(inspect.getsource(vars(tower_class)[name])):
            return Status(State.FIXED_UPSTREAM, "fast_pos_embed_interpolate no longer takes its device from "
                                                "pos_embed.weight")
        import comfy.ops
        import comfy.text_encoders.qwen3vl

        tower = tiny_qwen3vl_tower(comfy.text_encoders.qwen3vl.Qwen3VLVisionModel, comfy.ops.manual_cast)
        ours = interpolated_position_table(tower.pos_embed, TINY_QWEN3VL_GRID, tower.num_grid_per_side,
                                           tower.spatial_merge_size, tower.pos_embed.weight.dtype,
                                           torch.device("cpu"))
        if not torch.equal(ours, getattr(tower, name)(torch.tensor(TINY_QWEN3VL_GRID))):
            return Status(State.FAILED, "fast_pos_embed_interpolate computes something else than the pack's "
                                          "compute-device copy (interpolation changed upstream): fix left off")
        return Status(State.NEEDED, "fast_pos_embed_interpolate builds the table on pos_embed's weight device: "
                                     "with the weight in CPU RAM (dynamic VRAM, lowvram offload) every image "
                                     "interpolates on the CPU (no crash: forward moves the result)")

    def hook_loaded_model(self, model) -> list:
        return hook_towers(model)

    def attach(self, patcher, key: str) -> None:
        """The injection, plus a detach callback: ComfyUI unloading the model frees the resident tables."""
        super().attach(patcher, key)
        on_detach = _on_detach_event()
        if on_detach is not None and hasattr(patcher, "add_callback_with_key"):
            patcher.remove_callbacks_with_key(on_detach, key)
            patcher.add_callback_with_key(on_detach, key, _on_detach)

    def detach(self, patcher, key: str) -> None:
        super().detach(patcher, key)
        on_detach = _on_detach_event()
        if on_detach is not None and hasattr(patcher, "remove_callbacks_with_key"):
            patcher.remove_callbacks_with_key(on_detach, key)
        self.drop_resident_tables(patcher.model)


FIX = Qwen3VLPosEmbedFix()
