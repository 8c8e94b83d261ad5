"""transformers_qwen3vl_pos_embed: red/green on tiny random Qwen3-VL vision towers, on the installed transformers
(5.24, indexing form) and, in a subprocess, on transformers 5.8.0 (method form) from .venv/extra/transformers-5.8.0.

Which stand-in each form allows on a CPU-only machine (docs/qwen3vl_pos_embed.md):
* method form: end to end with the activations on meta and pos_embed on the CPU (the reverse of the seed), and
  with an offload-style pos_embed whose weight is meta (real values);
* indexing form: its forward needs grid_thw's data on the compute device, so the cross-device gather is checked
  at component level with pos_embed's weight on a FakeTensor cuda:0 (the CUDA error text), plus end to end with an
  offload-style pos_embed (no regression).
"""


import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
from hotfix_testing.concurrency import failures_running_concurrently  # noqa: E402
from minimax_hotfix import api  # noqa: E402
from minimax_hotfix import registry as pack_registry  # noqa: E402
from minimax_hotfix.diagnostics import self_test  # noqa: E402
from minimax_hotfix.diagnostics.self_tests import transformers_qwen3vl_pos_embed as tower_kit  # noqa: E402
from minimax_hotfix.kernels.fake_cuda import fake_cuda_mode, on_fake_cuda  # noqa: E402
from minimax_hotfix.kernels.qwen3vl_pos_embed import (  # noqa: E402
    computing_on,
    gather_rows,
    interpolated_position_table,
)
from minimax_hotfix.patches import transformers_qwen3vl_pos_embed as fix  # noqa: E402

FORM = fix.forward_form(fix.reference_tower_class())
# transformers 5.8.0 has the method form of the position-table code, the venv's latest the indexing form
# (test_detect_names_the_form)
method_form = pytest.mark.transformers("5.8.0")
indexing_form = pytest.mark.transformers("latest")
SAME_DEVICE = "Expected all tensors to be on the same device|is not on the expected device"


# every test here runs with the venv's transformers and with 5.8.0, except those of one form (below)
pytestmark = [pytest.mark.usefixtures("fresh_detection"), pytest.mark.transformers("latest", "5.8.0")]


class Holder(torch.nn.Module):
    """A model that holds a vision tower, as Qwen3VLModel holds ``visual``."""

    def __init__(self, tower):
        super().__init__()
        self.visual = tower


class OffloadedEmbedding(torch.nn.Embedding):
    """Stands in for accelerate's CPU offload: the module's weight is meta and the real one is brought per call."""

    def __init__(self, embedding: torch.nn.Embedding):
        super().__init__(*embedding.weight.shape, device="meta")
        self.stored = embedding.weight.detach().clone()

    def forward(self, indices):
        return F.embedding(indices.to(self.stored.device), self.stored)


def run(tower, pixels, grid):
    with torch.no_grad():
        return tower_kit.outputs(tower(pixels, grid))


def test_detect_names_the_form():
    status = pack_registry.status(fix.FIX)
    assert status.state is pack_registry.State.NEEDED
    assert ("pos_embed's weight device" if FORM == fix.METHOD_FORM else "grid_thw's device") in status.reason


def test_one_device_outputs_are_bit_identical():
    tower = tower_kit.tiny_tower()
    pixels, grid = tower_kit.tiny_inputs()
    reference = run(tower, pixels, grid)
    model = Holder(tower)
    assert api.attach_to_transformers_model(model) == ["visual"]
    patched = run(tower, pixels, grid)
    assert all(torch.equal(a, b) for a, b in zip(patched, reference, strict=True))
    assert len(patched) == len(reference) == 3


def _compute_on_meta_with(tower, keep_on_cpu: str):
    """Everything on meta except one CPU tensor: ``pos_embed`` (offloaded) or the rotary ``inv_freq`` buffer."""
    kept = tower.get_submodule(keep_on_cpu)
    saved = {name: tensor.detach().clone() for name, tensor in [*kept.named_parameters(), *kept.named_buffers()]}
    tower.to("meta")
    for name, tensor in saved.items():
        if isinstance(getattr(kept, name), torch.nn.Parameter):
            setattr(kept, name, torch.nn.Parameter(tensor, requires_grad=False))
        else:
            setattr(kept, name, tensor)
    return tower


@method_form
@pytest.mark.parametrize("offloaded", ["pos_embed", "rotary_pos_emb"])
def test_method_form_table_follows_the_activations(offloaded):
    tower = _compute_on_meta_with(tower_kit.tiny_tower(), offloaded)
    pixels, grid = tower_kit.tiny_inputs()
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        run(tower, pixels.to("meta"), grid)

    api.attach_to_transformers_model(tower)
    patched = run(tower, pixels.to("meta"), grid)
    reference = run(tower_kit.tiny_tower(), *tower_kit.tiny_inputs())
    assert [t.device.type for t in patched] == ["meta"] * 3
    assert [t.shape for t in patched] == [t.shape for t in reference]


def _offloaded_pos_embed_tower():
    """A tiny tower whose pos_embed is offload-style (meta weight), its inputs, and its outputs before offloading."""
    tower = tower_kit.tiny_tower()
    pixels, grid = tower_kit.tiny_inputs()
    reference = run(tower, pixels, grid)
    tower.pos_embed = OffloadedEmbedding(tower.pos_embed)
    return tower, pixels, grid, reference


@method_form
def test_method_form_offloaded_meta_weight_gives_the_reference_values():
    tower, pixels, grid, reference = _offloaded_pos_embed_tower()
    with pytest.raises((RuntimeError, NotImplementedError)):  # the stock method builds its indices on meta
        run(tower, pixels, grid)

    api.attach_to_transformers_model(tower)
    assert all(torch.equal(a, b) for a, b in zip(run(tower, pixels, grid), reference, strict=True))


@method_form
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_method_form_bit_for_bit(dtype):
    tower = tower_kit.tiny_tower().to(dtype)
    grids = [(1, 4, 6), (2, 2, 2), (3, 10, 14), (1, 32, 18)]
    stock = tower.fast_pos_embed_interpolate(torch.tensor(grids))
    ours = interpolated_position_table(tower.pos_embed, grids, tower.num_grid_per_side,
                                       tower.config.spatial_merge_size, dtype, torch.device("cpu"))
    assert ours.dtype == stock.dtype and torch.equal(ours, stock)


@indexing_form
@pytest.mark.parametrize("patches_in_call", [2, 32], ids=["rows-cross", "table-crosses"])
def test_indexing_form_gather_with_pos_embed_on_fake_cuda(patches_in_call):
    tower = tower_kit.tiny_tower()
    table = tower.pos_embed.weight.detach().clone()
    indices = torch.randint(0, 16, (patches_in_call, 4), generator=torch.Generator().manual_seed(3))
    with fake_cuda_mode() as mode:
        tower.pos_embed.weight = torch.nn.Parameter(on_fake_cuda(mode, table), requires_grad=False)
        with computing_on(tower, torch.device("cpu")):
            with pytest.raises(RuntimeError, match="found at least two devices, cuda:0 and cpu"):
                tower.pos_embed(indices)
            api.attach_to_transformers_model(tower)
            rows = tower.pos_embed(indices)
    assert rows.device.type == "cpu" and rows.shape == (patches_in_call, 4, 32)


@pytest.mark.parametrize("patches_in_call", [2, 32])
def test_gather_rows_values_equal_a_plain_lookup(patches_in_call):
    embedding = torch.nn.Embedding(16, 8)
    indices = torch.randint(0, 16, (patches_in_call, 4), generator=torch.Generator().manual_seed(4))
    moved = gather_rows(embedding, indices, 16, torch.device("cpu"), torch.device("meta"))
    assert moved.device.type == "meta" and moved.shape == (patches_in_call, 4, 8)
    same = gather_rows(embedding, indices, 16, torch.device("cpu"), torch.device("cpu"))
    assert torch.equal(same, embedding(indices))


@indexing_form
def test_indexing_form_grid_follows_the_activations():
    tower = tower_kit.tiny_tower()
    pixels, grid = tower_kit.tiny_inputs()
    api.attach_to_transformers_model(tower)
    seen = []
    probe = tower.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(
        (args[1] if len(args) > 1 else kwargs["grid_thw"]).device), with_kwargs=True)
    try:
        # a meta grid has no data to build indices from (transformers' error type varies by version); we only watch
        # the move
        with pytest.raises(Exception):  # noqa: B017
            tower(pixels.to("meta"), grid)
        with pytest.raises(Exception):  # noqa: B017
            tower(hidden_states=pixels.to("meta"), grid_thw=grid)
    finally:
        probe.remove()
    assert seen == [torch.device("meta")] * 2


@indexing_form
def test_indexing_form_offloaded_meta_weight_still_works():
    tower, pixels, grid, reference = _offloaded_pos_embed_tower()
    assert all(torch.equal(a, b) for a, b in zip(run(tower, pixels, grid), reference, strict=True))
    api.attach_to_transformers_model(tower)
    assert all(torch.equal(a, b) for a, b in zip(run(tower, pixels, grid), reference, strict=True))


def _cross_device_call():
    """One call of a tower whose activations are on meta and its pos_embed on the CPU, with its check. The
    indexing form runs the gather alone (its forward needs grid data on the compute device)."""
    if FORM == fix.METHOD_FORM:
        tower = _compute_on_meta_with(tower_kit.tiny_tower(), "pos_embed")
        api.attach_to_transformers_model(tower)
        pixels, grid = tower_kit.tiny_inputs()
        pixels = pixels.to("meta")
        return lambda: all(t.device.type == "meta" for t in run(tower, pixels, grid))
    tower = tower_kit.tiny_tower()
    api.attach_to_transformers_model(tower)
    meta = torch.device("meta")
    indices = torch.randint(0, 16, (32, 4), generator=torch.Generator().manual_seed(5)).to(meta)

    def call():  # indices built from a grid_thw on the compute device; pos_embed stays on the CPU
        with computing_on(tower, meta):
            return tower.pos_embed(indices).device == meta

    return call


def test_two_threads_two_devices_no_cross_talk():
    resident = tower_kit.tiny_tower()
    pixels, grid = tower_kit.tiny_inputs()
    reference = run(resident, pixels, grid)
    api.attach_to_transformers_model(resident)
    cross_device = _cross_device_call()

    def resident_call():
        return all(torch.equal(a, b) for a, b in zip(run(resident, pixels, grid), reference, strict=True))

    assert failures_running_concurrently([resident_call, cross_device], rounds=40) == []


def test_attach_replaces_and_detach_restores():
    tower = tower_kit.tiny_tower()
    model = Holder(tower)
    before = (dict(vars(tower)), dict(vars(tower.pos_embed)), len(tower._forward_pre_hooks),
              len(tower._forward_hooks), len(tower.patch_embed._forward_hooks))
    api.attach_to_transformers_model(model)
    once = (set(vars(tower)), set(vars(tower.pos_embed)), len(tower._forward_pre_hooks))
    api.attach_to_transformers_model(model)
    assert (set(vars(tower)), set(vars(tower.pos_embed)), len(tower._forward_pre_hooks)) == once
    api.detach_from_transformers_model(model)
    assert (dict(vars(tower)), dict(vars(tower.pos_embed)), len(tower._forward_pre_hooks),
            len(tower._forward_hooks), len(tower.patch_embed._forward_hooks)) == before


def test_off_switch_attaches_nothing(monkeypatch):
    monkeypatch.setenv(pack_registry.DISABLE_ENV, fix.FIX.id)
    tower = tower_kit.tiny_tower()
    hooks = len(tower._forward_pre_hooks)
    assert api.attach_to_transformers_model(tower) == []
    assert len(tower._forward_pre_hooks) == hooks and "fast_pos_embed_interpolate" not in vars(tower)


def test_self_test_reproduces_the_bug_and_passes():
    checks = list(self_test(fix.FIX))
    assert any(check.name.startswith("red") for check in checks)
    assert all(check.passed for check in checks), checks
