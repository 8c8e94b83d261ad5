"""Fix ``transformers_qwen3vl_pos_embed``: transformers' Qwen3-VL vision towers crash with "Expected all tensors to be
on the same device, but found at least two devices, cuda:0 and cpu!" when ``pos_embed`` (or ``grid_thw``) is on
another device than the activations.

Bug (``transformers/models/qwen3_vl/modeling_qwen3_vl.py`` ``Qwen3VLVisionModel`` and the towers copied from it:
qwen3_vl_moe, qwen3_5, qwen3_5_moe, qwen3_omni_moe):
  * <= 5.8 (method form): ``fast_pos_embed_interpolate`` builds the table on ``self.pos_embed.weight.device`` and
    ``forward`` adds it to ``hidden_states`` with no move (5.8.0 l.707 and l.783). A weight left in CPU RAM by a
    partial loader that casts weights per op (the seed: two MiniMax H3 jobs, 5.5.4) crashes at the add; an
    accelerate-offloaded weight (meta) crashes inside the method.
  * >= 5.9 (indexing form): ``forward`` gathers ``self.pos_embed(interp_indices)`` with indices built on
    ``grid_thw.device`` and never reconciles devices: a ``pos_embed`` on another device than ``grid_thw`` crashes in
    the gather; a ``grid_thw`` on another device than ``hidden_states`` crashes at the add or in the rotary table.
The fix, attached per model by ``attach_to_transformers_model(model)`` (custom nodes that run these models call
it; ComfyUI's loaders never build them): the compute device is read per call from the activations (a ContextVar
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

import contextlib
import inspect
import logging
import re
import weakref
from typing import Iterable

import torch

from ..kernels.qwen3vl_pos_embed import (
    compute_device, computing_on, gather_rows, grid_shapes, interpolated_position_table, remove_handles,
    track_compute_device,
)
from ._fix import AttributeOverride, Check, Fix, State, Status

log = logging.getLogger("minimax_hotfix")

METHOD_FORM, INDEXING_FORM = "method", "indexing"

_attached: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def _forward_form(tower_class) -> str | None:
    names = inspect.unwrap(tower_class.forward).__code__.co_names
    if "fast_pos_embed_interpolate" in names:
        return METHOD_FORM
    if "pos_embed" in names and "patch_embed" in names:
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


def _install(tower, form: str) -> list:
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


def _detach_tower(tower) -> None:
    remove_handles(_attached.pop(tower, []))


def attach_to_transformers_model(model: torch.nn.Module) -> list[str]:
    """Make every Qwen3-VL-family vision tower inside ``model`` device-safe; return the patched module names.

    For custom nodes that run transformers' Qwen3-VL / Qwen3.5 / Qwen3-Omni models (captioners, prompt enhancers)
    next to MiniMax workflows, and may keep ``pos_embed`` in CPU RAM, offload it, or pass ``grid_thw`` on the CPU::

        import minimax_hotfix                    # the pack's public name inside ComfyUI
        model = Qwen3VLForConditionalGeneration.from_pretrained(...)
        minimax_hotfix.attach_to_transformers_model(model)      # e.g. ["model.visual"]

    Only ``model``'s own modules change (hooks and instance attributes), so other models are untouched; calling it
    again replaces, never stacks; ``detach_from_transformers_model`` undoes it. Safe with concurrent calls from
    several threads. Attaches nothing (returns []) when the fix is switched off or not needed by this transformers.
    """
    from . import status

    state = status(FIX)
    if state.state is not State.APPLIED:
        log.info("MiniMax Hotfix: %s not attached: %s (%s)", FIX.id, state.state.value, state.reason)
        return []
    attached = []
    for name, module in model.named_modules():
        if not _is_vision_tower(module):
            continue
        form = _forward_form(type(module))
        if form is None:
            log.warning("MiniMax Hotfix: %s: %s.forward matches no known form; left unpatched",
                        FIX.id, type(module).__name__)
            continue
        _detach_tower(module)
        _attached[module] = _install(module, form)
        attached.append(name or type(module).__name__)
    return attached


def detach_from_transformers_model(model: torch.nn.Module) -> None:
    """Undo ``attach_to_transformers_model`` on every tower of ``model``."""
    for module in model.modules():
        _detach_tower(module)


def _reference_tower_class():
    try:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    except ImportError:
        return None
    return Qwen3VLVisionModel


def tiny_tower(seed: int = 0):
    """A random 2-block Qwen3-VL vision tower (hidden 32, 16 positions), on CPU, for tests and the self-test."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    tower_class = _reference_tower_class()
    config = Qwen3VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                                 patch_size=4, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=40,
                                 num_position_embeddings=16, deepstack_visual_indexes=[0])
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):  # seeded weights, the caller's random state left as it was
        torch.default_generator.manual_seed(seed)
        return tower_class(config).eval()


TINY_GRID = ((1, 4, 6), (2, 2, 2))


def tiny_inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    patches = sum(t * h * w for t, h, w in TINY_GRID)
    pixels = torch.randn(patches, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))
    return pixels, torch.tensor(TINY_GRID)


def outputs(result) -> list[torch.Tensor]:
    return [result.last_hidden_state, result.pooler_output, *result.deepstack_features]


@contextlib.contextmanager
def _installed(tower, form: str):
    """The fix on the self-test's private ``tower`` for one step of the check."""
    handles = _install(tower, form)
    try:
        yield
    finally:
        remove_handles(handles)


def _fails_check(name: str, call) -> Check:
    """A red control: passes when ``call`` raises the device-mismatch RuntimeError."""
    try:
        call()
    except RuntimeError as exc:
        return Check(name, True, str(exc).splitlines()[0][:120])
    return Check(name, False, "it ran")


class TransformersQwen3VLPosEmbedFix(Fix):
    id = "transformers_qwen3vl_pos_embed"
    title = "transformers Qwen3-VL vision towers: position table on the compute device (attach_to_transformers_model)"
    targets = ()
    upstream = "verl-project/verl#5571"

    def detect(self) -> Status:
        tower_class = _reference_tower_class()
        if tower_class is None:
            return Status(State.NOT_APPLICABLE, "transformers with Qwen3-VL is not installed")
        import transformers

        version = transformers.__version__
        form = _forward_form(tower_class)
        if form == METHOD_FORM:
            if not re.search(r"pos_embed\.weight\.device", inspect.getsource(tower_class.fast_pos_embed_interpolate)):
                return Status(State.FIXED_UPSTREAM, f"transformers {version}: fast_pos_embed_interpolate no longer "
                                                    "builds on pos_embed's weight device")
            return Status(State.APPLIED, f"transformers {version}: the vision tower adds a position table built on "
                                         "pos_embed's weight device to the activations; custom nodes attach the "
                                         "fix with attach_to_transformers_model(model)")
        if form == INDEXING_FORM:
            if "hidden_states.device" in inspect.getsource(inspect.unwrap(tower_class.forward)):
                return Status(State.FIXED_UPSTREAM, f"transformers {version}: the vision tower's forward reconciles "
                                                    "devices with hidden_states")
            return Status(State.APPLIED, f"transformers {version}: the vision tower gathers pos_embed with indices "
                                         "built on grid_thw's device and never reconciles devices; custom nodes "
                                         "attach the fix with attach_to_transformers_model(model)")
        return Status(State.FAILED, "Qwen3VLVisionModel.forward uses neither fast_pos_embed_interpolate nor "
                                      "pos_embed: target drifted, fix left off")

    def self_test(self) -> Iterable[Check]:
        if _reference_tower_class() is None:
            return ()
        tower = tiny_tower()
        form = _forward_form(type(tower))
        pixels, grid = tiny_inputs()
        with torch.no_grad():
            reference = outputs(tower(pixels, grid))
            with _installed(tower, form):
                patched = outputs(tower(pixels, grid))
        all_on_cpu = Check("green: all on cpu, outputs bit-identical to the unpatched tower",
                           all(map(torch.equal, patched, reference)))
        return [*_cross_device_checks(tower, form, pixels, grid, reference), all_on_cpu]


def _cross_device_checks(tower, form: str, pixels, grid, reference) -> Iterable[Check]:
    """Red/green with ``pos_embed`` on another device than the activations: end to end on a real accelerator;
    on a CPU-only machine with the stand-in each form allows (see docs/qwen3vl_pos_embed.md)."""
    from ._devices import real_accelerator

    accelerator = real_accelerator()
    if accelerator is None and form == INDEXING_FORM:
        yield from _fake_cuda_gather_checks(tower, len(pixels))
        return
    with torch.no_grad():
        if accelerator is not None:
            tower.to(accelerator)
            tower.pos_embed.to("cpu")
            args = (pixels.to(accelerator), grid.to(accelerator))
            label = f"pos_embed on cpu, compute on {accelerator.type}"
        else:
            offloaded = torch.nn.Parameter(tower.pos_embed.weight.detach().clone())
            tower.to("meta")
            tower.pos_embed.weight = offloaded
            args = (pixels.to("meta"), grid)
            label = "pos_embed on cpu, compute on meta"
        yield _fails_check(f"red: unpatched, {label}: forward fails", lambda: tower(*args))
        with _installed(tower, form):
            try:
                fixed = outputs(tower(*args))
            except Exception as exc:
                yield Check(f"green: patched, {label}: forward runs", False, f"{type(exc).__name__}: {exc}")
                return
    if accelerator is None:
        passed = all(t.device.type == "meta" for t in fixed) and [t.shape for t in fixed] == [
            t.shape for t in reference]
        yield Check(f"green: patched, {label}: forward runs, outputs on meta with the right shapes", passed)
    else:
        passed = all(torch.allclose(a.cpu(), b, rtol=1e-5, atol=1e-6) for a, b in zip(fixed, reference))
        yield Check(f"green: patched, {label}: outputs equal the all-on-cpu reference", passed)


def _fake_cuda_gather_checks(tower, patches: int) -> Iterable[Check]:
    """Indexing form without an accelerator: its forward needs grid data on the compute device, so only the gather
    is checked, with the weight on a FakeTensor cuda:0 and the call computing on the CPU."""
    from ._devices import fake_cuda_mode, on_fake_cuda

    indices = torch.randint(0, tower.pos_embed.num_embeddings, (patches, 4), generator=torch.Generator().manual_seed(2))
    label = "pos_embed on (fake) cuda:0, compute on cpu"
    with fake_cuda_mode() as mode:
        tower.pos_embed.weight = torch.nn.Parameter(on_fake_cuda(mode, tower.pos_embed.weight), requires_grad=False)
        with computing_on(tower, torch.device("cpu")):
            yield _fails_check(f"red: unpatched, {label}: the gather fails", lambda: tower.pos_embed(indices))
            with _installed(tower, INDEXING_FORM):
                rows = tower.pos_embed(indices)
    yield Check(f"green: patched, {label}: the rows come back on cpu",
                rows.device.type == "cpu" and rows.shape == (patches, 4, tower.pos_embed.embedding_dim))


FIX = TransformersQwen3VLPosEmbedFix()
