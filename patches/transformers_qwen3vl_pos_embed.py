"""Fix ``transformers_qwen3vl_pos_embed``: transformers' Qwen3-VL vision towers crash when ``pos_embed`` (or
``grid_thw``) is on another device than the activations:
RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!

Bug (``transformers/models/qwen3_vl/modeling_qwen3_vl.py`` ``Qwen3VLVisionModel`` and the towers copied from it:
qwen3_vl_moe, qwen3_5, qwen3_5_moe, qwen3_omni_moe):
  * <= 5.8 (method form): ``fast_pos_embed_interpolate`` builds the table on ``self.pos_embed.weight.device`` and
    ``forward`` adds it to ``hidden_states`` with no move (5.8.0 l.707 and l.783). A weight left in CPU RAM by a
    partial loader that casts weights per op (the seed: two MiniMax H3 jobs, 5.5.4) crashes at the add; an
    accelerate-offloaded weight (meta) crashes inside the method.
  * >= 5.9 (indexing form): ``forward`` gathers ``self.pos_embed(interp_indices)`` with indices built on
    ``grid_thw.device`` and never reconciles devices: a ``pos_embed`` on another device than ``grid_thw`` crashes in
    the gather; a ``grid_thw`` on another device than ``hidden_states`` crashes at the add or in the rotary table.
The fix, attached per model by the pack's public ``attach_to_transformers_model(model)`` (api.py: custom nodes that
run these models call it; ComfyUI's loaders never build them): the compute device is read per call from the activations (a ContextVar
frame opened by the tower's own forward: two jobs in two threads never share it);
  * method form: the table is still built where the weight lives and only the N x hidden result crosses, once per
    call (a meta weight, brought by an offload hook at call time, is interpolated on the compute device instead);
    ``rot_pos_emb``'s table (built on the ``inv_freq`` buffer's device) is moved the same way;
  * indexing form: ``grid_thw`` follows ``hidden_states``, and ``pos_embed`` gathers where its weight lives and
    hands back rows on the compute device (the smaller of the needed rows and the whole table crosses, once).
Everything on one device: no move happens and outputs are bit-identical to the unpatched model.
Upstream: verl-project/verl#5571 (open, same error on npu); no transformers fix up to 5.24.0.
Applies to: transformers >= 4.57 with Qwen3-VL (4.57.6, 5.0-5.8 method form; 5.9-5.24 indexing form checked).
Already fixed upstream when the method form no longer reads ``pos_embed.weight.device``, or the indexing form's
``forward`` refers to ``hidden_states.device``; failed (left off) when ``forward`` uses neither form.
Off switch: ``MINIMAX_HOTFIX_DISABLE=transformers_qwen3vl_pos_embed`` (``attach_to_transformers_model`` then
attaches nothing).
"""

from __future__ import annotations

import inspect
import re
import threading
import weakref

import torch

from ..contract import AttributeOverride, Fix, Retirement, State, Status, log, remove_handles
from ..kernels.qwen3vl_pos_embed import (
    compute_device,
    gather_rows,
    grid_shapes,
    interpolated_position_table,
    track_compute_device,
)

METHOD_FORM, INDEXING_FORM = "method", "indexing"


def forward_form(tower_class) -> str | None:
    """The method form, the indexing form (``forward`` gathers through the ``pos_embed`` module itself, where the fix
    hooks it: a gather that reads its weight some other way is not repaired there), or None."""
    forward = inspect.unwrap(tower_class.forward)
    names = forward.__code__.co_names
    if "fast_pos_embed_interpolate" in names:
        return METHOD_FORM
    if "pos_embed" in names and "patch_embed" in names and re.search(r"self\.pos_embed\(", inspect.getsource(forward)):
        return INDEXING_FORM
    return None


def _is_vision_tower(module) -> bool:
    return (isinstance(getattr(module, "pos_embed", None), torch.nn.Embedding)
            and isinstance(getattr(module, "patch_embed", None), torch.nn.Module)
            and hasattr(module, "num_grid_per_side"))


def _table_on_compute_device(tower, stock):
    """Method form: ``fast_pos_embed_interpolate`` whose result is on the device the current call computes on."""

    def fast_pos_embed_interpolate(grid_thw):
        device = compute_device(tower)
        weight = tower.pos_embed.weight
        if device is None or weight.device == device:
            return stock(grid_thw)
        if weight.is_meta:  # an offload hook brings the weight at call time; the stock method would build on meta
            return interpolated_position_table(tower.pos_embed, grid_shapes(grid_thw), tower.num_grid_per_side,
                                               tower.config.spatial_merge_size, weight.dtype, device)
        return stock(grid_thw).to(device)

    return fast_pos_embed_interpolate


def _result_on_compute_device(tower, stock):
    """Method form: ``stock`` (``rot_pos_emb``) with its result moved to the device the current call computes on."""

    def on_compute_device(*args, **kwargs):
        result = stock(*args, **kwargs)
        device = compute_device(tower)
        return result if device is None else result.to(device)

    return on_compute_device


def _rows_on_compute_device(tower, stock):
    """Indexing form: ``pos_embed.forward`` gathering where the weight lives, rows returned on the compute device."""
    embedding = tower.pos_embed

    def forward(indices):
        device = compute_device(tower)
        if device is None:
            return stock(indices)
        weight = embedding.weight
        if weight.is_meta:  # an offload hook places weight and indices itself
            return stock(indices).to(device)
        return gather_rows(stock, indices, embedding.num_embeddings, weight.device, device)

    return forward


def _grid_follows_activations(tower, args, kwargs):
    """Indexing form, forward pre-hook: ``grid_thw`` moved to ``hidden_states``' device (None: leave the call as is)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    grid_positional = len(args) > 1
    grid = args[1] if grid_positional else kwargs.get("grid_thw")
    if not isinstance(hidden, torch.Tensor) or not isinstance(grid, torch.Tensor) or grid.device == hidden.device:
        return None
    if grid_positional:
        return (args[0], grid.to(hidden.device), *args[2:]), kwargs
    return args, {**kwargs, "grid_thw": grid.to(hidden.device)}


def hook_tower(tower, form: str) -> list:
    handles = track_compute_device(tower, "hidden_states", refine_from=tower.patch_embed)
    if form == METHOD_FORM:
        handles.append(AttributeOverride(tower, "fast_pos_embed_interpolate",
                                         _table_on_compute_device(tower, tower.fast_pos_embed_interpolate)))
        if callable(getattr(tower, "rot_pos_emb", None)):
            handles.append(AttributeOverride(tower, "rot_pos_emb",
                                             _result_on_compute_device(tower, tower.rot_pos_emb)))
    else:
        handles.append(tower.register_forward_pre_hook(_grid_follows_activations, with_kwargs=True))
        handles.append(AttributeOverride(tower.pos_embed, "forward",
                                         _rows_on_compute_device(tower, tower.pos_embed.forward)))
    return handles


def reference_tower_class():
    try:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    except ImportError:
        return None
    return Qwen3VLVisionModel


class TransformersQwen3VLPosEmbedFix(Fix):
    id = "transformers_qwen3vl_pos_embed"
    targets = ()  # attached by api.attach_to_transformers_model, which other custom nodes call
    retirement = Retirement(
        fixed_by="none yet: a transformers release whose Qwen3-VL vision tower reconciles pos_embed / grid_thw with "
                 "hidden_states' device",
        delete_when="every transformers the supported cores run reads 'fixed upstream' here")

    def __init__(self):
        self._lock = threading.Lock()
        self._attached: weakref.WeakKeyDictionary[torch.nn.Module, list] = weakref.WeakKeyDictionary()  # tower: handles

    def detect(self) -> Status:
        tower_class = reference_tower_class()
        if tower_class is None:
            return Status(State.NOT_APPLICABLE, "transformers with Qwen3-VL is not installed")
        import transformers

        version = transformers.__version__
        form = forward_form(tower_class)
        if form == METHOD_FORM:
            if not re.search(r"pos_embed\.weight\.device", inspect.getsource(tower_class.fast_pos_embed_interpolate)):
                return Status(State.FIXED_UPSTREAM, f"transformers {version}: fast_pos_embed_interpolate no longer "
                                                    "builds on pos_embed's weight device")
            return Status(State.NEEDED, f"transformers {version}: the vision tower adds a position table built on "
                                         "pos_embed's weight device to the activations; custom nodes attach the "
                                         "fix with attach_to_transformers_model(model)")
        if form == INDEXING_FORM:
            if "hidden_states.device" in inspect.getsource(inspect.unwrap(tower_class.forward)):
                return Status(State.FIXED_UPSTREAM, f"transformers {version}: the vision tower's forward reconciles "
                                                    "devices with hidden_states")
            return Status(State.NEEDED, f"transformers {version}: the vision tower gathers pos_embed with indices "
                                         "built on grid_thw's device and never reconciles devices; custom nodes "
                                         "attach the fix with attach_to_transformers_model(model)")
        return Status(State.FAILED, "Qwen3VLVisionModel.forward uses neither fast_pos_embed_interpolate nor "
                                      "pos_embed: target drifted, fix left off")

    def attach_to_towers(self, model: torch.nn.Module) -> list[str]:
        """Patch every Qwen3-VL-family vision tower inside ``model`` (what ``api.attach_to_transformers_model`` runs
        once the registry says the fix applies); return the patched module names. Calling it again replaces, never
        stacks."""
        attached = []
        for name, module in model.named_modules():
            if not _is_vision_tower(module):
                continue
            form = forward_form(type(module))
            if form is None:
                log.warning("MiniMax Hotfix: %s: %s.forward matches no known form; left unpatched",
                            self.id, type(module).__name__)
                continue
            with self._lock:  # unhook-then-hook: two attaches interleaved would each hook and lose one's handles
                remove_handles(self._attached.pop(module, []))
                self._attached[module] = hook_tower(module, form)
            attached.append(name or type(module).__name__)
        self.link.hooked(model, len(attached))
        return attached

    def detach_from_towers(self, model: torch.nn.Module) -> None:
        with self._lock:
            for module in model.modules():
                remove_handles(self._attached.pop(module, []))


FIX = TransformersQwen3VLPosEmbedFix()
