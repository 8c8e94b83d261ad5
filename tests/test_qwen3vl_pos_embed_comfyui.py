"""qwen3vl_pos_embed on ComfyUI's real Qwen3-VL vision tower (tiny config, COMFYUI_PATH; skipped without it).

The finding this pins (docs/qwen3vl_pos_embed.md): with pos_embed's weight in CPU RAM and the activations on another
device, stock ComfyUI does not crash (forward moves the table) but runs the 4-tap gather and weighted sum on the CPU
on every call, and under dynamic VRAM also clones the whole table there. The CPU-only stand-in for the compute
device is meta: ComfyUI's ops cast weights to the input's device, so a tower with CPU weights runs on meta.
"""

import pytest
import torch

from hotfix_testing.concurrency import failures_running_concurrently
from minimax_hotfix import registry as pack_registry
from minimax_hotfix.contract import remove_handles
from minimax_hotfix.diagnostics import self_test
from minimax_hotfix.diagnostics.self_tests import qwen3vl_pos_embed as tower_kit
from minimax_hotfix.diagnostics.tiny_qwen3vl import TINY_QWEN3VL_GRID, tiny_qwen3vl_tower
from minimax_hotfix.kernels.qwen3vl_pos_embed import interpolated_position_table
from minimax_hotfix.patches import qwen3vl_pos_embed as fix

GRID = TINY_QWEN3VL_GRID
pixels = tower_kit.tiny_pixels


pytestmark = pytest.mark.usefixtures("comfyui", "fresh_detection")


def offloaded_tower(ops_name="manual_cast"):
    """Every weight on meta (the compute device stand-in) except pos_embed's, which stays in CPU RAM."""
    import comfy.ops

    tower = tiny_qwen3vl_tower(ops=getattr(comfy.ops, ops_name))
    weight = torch.nn.Parameter(tower.pos_embed.weight.detach().clone(), requires_grad=False)
    tower.to("meta")
    tower.pos_embed.weight = weight
    return tower


def gather_devices(tower):
    seen = []
    tower.pos_embed.register_forward_pre_hook(lambda mod, args: seen.append(args[0].device.type))
    return seen


@pytest.mark.cores("0.38 Qwen3-VL", "0.39 era")
def test_detect_applies_on_this_comfyui():
    status = pack_registry.status(fix.FIX)
    assert status.state is pack_registry.State.NEEDED, status.reason
    assert "interpolates on the CPU" in status.reason


@pytest.mark.parametrize("fix_id", ["qwen3vl_pos_embed", "qwen3vl_rotary_table"])
def test_detect_under_dynamic_vram(monkeypatch, fix_id):
    """Under dynamic VRAM (ComfyUI's default on NVIDIA) ComfyUI's ops build layers without weights, materialized from
    the state dict at load. Red: a tiny tower whose weights are set through ``parameter.data`` (how the pack built it
    before the seed 001 dynamic-VRAM scenario found it) cannot be built, so detection failed and both tower fixes
    were left off exactly where they matter most. Green: built through ``load_state_dict``, detection finds them
    needed."""
    import comfy.memory_management
    import comfy.ops
    from comfy.text_encoders.qwen3vl import Qwen3VLVisionModel

    from minimax_hotfix.kernels.qwen3vl_pos_embed import TINY_QWEN3VL_TOWER

    monkeypatch.setattr(comfy.memory_management, "aimdo_enabled", True)
    tower = Qwen3VLVisionModel({**TINY_QWEN3VL_TOWER, "deepstack_visual_indexes": [0]}, dtype=torch.float32,
                               ops=comfy.ops.manual_cast)
    assert tower.blocks[0].attn.qkv.weight is None  # materialized by load_state_dict
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        for parameter in tower.parameters():
            parameter.data = torch.randn(parameter.shape)
    status = pack_registry.status(pack_registry.fix_named(fix_id))
    assert status.state is pack_registry.State.NEEDED, status.reason


@pytest.mark.cores("0.38 Qwen3-VL", "0.39 era")
def test_offloaded_pos_embed_no_crash_but_gather_on_cpu_then_on_compute_device():
    tower = offloaded_tower()
    seen = gather_devices(tower)
    stock = tower_kit.outputs(tower(pixels().to("meta"), torch.tensor(GRID)))  # pinned: stock ComfyUI does not crash
    assert seen == ["cpu"]  # red: the interpolation ran where the weight lives

    seen.clear()
    handles = fix.hook_towers(tower)
    fixed = tower_kit.outputs(tower(pixels().to("meta"), torch.tensor(GRID)))
    assert seen == ["meta"]  # green: it ran on the compute device
    assert [(t.device.type, t.shape) for t in fixed] == [(t.device.type, t.shape) for t in stock]
    remove_handles(handles)
    assert "fast_pos_embed_interpolate" not in vars(tower)


def test_dynamic_vram_cast_clones_the_whole_table_per_call():
    """Pins the dynamic-VRAM cost: a vbar module (``_v``) called with a CPU input takes comfy.ops' CPU branch,
    which copies the whole weight on every call (stock only: the vbar branch the fix leads to needs CUDA)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class TableCopies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.clone.default) and args[0].shape == (64, 32):
                TableCopies.count += 1
            return func(*args, **(kwargs or {}))

    tower = tiny_qwen3vl_tower()
    tower.pos_embed._v = object()  # what ModelPatcherDynamic.load gives every cast module above 16 KB
    with TableCopies():
        for _ in range(3):
            tower.fast_pos_embed_interpolate(torch.tensor(GRID))
    assert TableCopies.count == 3


@pytest.mark.cores("0.38 Qwen3-VL")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_comfyui_method_bit_for_bit(dtype):
    tower = tiny_qwen3vl_tower(dtype)
    grid = ((1, 4, 6), (2, 2, 2), (3, 10, 14), (1, 64, 38))
    stock = tower.fast_pos_embed_interpolate(torch.tensor(grid))
    ours = interpolated_position_table(tower.pos_embed, list(grid), tower.num_grid_per_side,
                                       tower.spatial_merge_size, tower.pos_embed.weight.dtype, torch.device("cpu"))
    assert ours.dtype == stock.dtype and torch.equal(ours, stock)


def test_all_on_one_device_outputs_bit_identical():
    tower = tiny_qwen3vl_tower()
    reference = tower_kit.outputs(tower(pixels(), torch.tensor(GRID)))
    fix.hook_towers(tower)
    assert all(map(torch.equal, tower_kit.outputs(tower(pixels(), torch.tensor(GRID))), reference))


def test_ops_that_do_not_cast_keep_the_stock_path():
    """disable_weight_init leaves comfy_cast_weights off: its Embedding cannot reach a CPU weight from meta
    indices, so the fix must leave such a tower alone (without the guard this call crashes)."""
    tower = offloaded_tower("disable_weight_init")
    seen = gather_devices(tower)
    fix.hook_towers(tower)
    out = tower_kit.outputs(tower(pixels().to("meta"), torch.tensor(GRID)))
    assert seen == ["cpu"] and out[0].device.type == "meta"


@pytest.mark.fails_switched_off("qwen3vl_pos_embed", "'cpu'", cores=("0.38 Qwen3-VL", "0.39 era",))
def test_attaches_through_the_model_patcher_and_survives_clone():
    import comfy.model_patcher

    holder = torch.nn.Module()
    holder.visual = offloaded_tower()
    patcher = comfy.model_patcher.ModelPatcher(holder, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    attached = pack_registry.attach_fixes(patcher, "clip")  # as the pack's CLIP loader: MINIMAX_HOTFIX_DISABLE honoured
    assert ("qwen3vl_pos_embed" in attached) is (pack_registry.status(fix.FIX).state is pack_registry.State.NEEDED)
    clone = patcher.clone()
    seen = gather_devices(holder.visual)
    hooked = []
    for each in (patcher, clone):
        each.inject_model()
        hooked.append("fast_pos_embed_interpolate" in vars(holder.visual))
        holder.visual(pixels().to("meta"), torch.tensor(GRID))
        each.eject_model()
        hooked.append("fast_pos_embed_interpolate" in vars(holder.visual))
        holder.visual(pixels().to("meta"), torch.tensor(GRID))
    # The first injected call casts the table to meta through pos_embed; the clone's reuses it (no gather call);
    # ejected, the stock method gathers on the CPU. Checked first: with the fix off, this is the bug's own symptom.
    assert seen == ["meta", "cpu", "cpu"]
    assert hooked == [True, False, True, False]
    kept = fix.FIX.resident_tables(holder.visual).resident_bytes()
    assert kept > 0
    # load_models_gpu detaches a loaded model without unpatching before every reload (0.33.0: each prompt): the
    # weights stay, so do the tables; red against a callback that drops them on any detach (the whole table was
    # resent per prompt on the simulated device)
    patcher.detach(unpatch_all=False)
    assert fix.FIX.resident_tables(holder.visual).resident_bytes() == kept
    # ComfyUI unloading the model (model_unload: detach(unpatch_all=True)) frees them; meta weights cannot move
    # back to the CPU, and moving them is not what is checked here
    clone.unpatch_model = lambda *args, **kwargs: None
    clone.detach(unpatch_all=True)
    assert fix.FIX.resident_tables(holder.visual).resident_bytes() == 0


def test_off_switch(monkeypatch):
    monkeypatch.setenv(pack_registry.DISABLE_ENV, fix.FIX.id)
    assert pack_registry.status(fix.FIX).state is pack_registry.State.DISABLED


def test_a_call_on_the_weights_own_device_keeps_the_other_devices_table():
    """One tower with CPU weights computing on meta and on the CPU (two jobs; stock ops cast the weights per call): the
    CPU call needs no copy, and must not drop the meta table, which the next meta call would then send again."""
    tower = tiny_qwen3vl_tower()
    fix.hook_towers(tower)
    tower(pixels().to("meta"), torch.tensor(GRID))
    kept = fix.FIX.resident_tables(tower).resident_bytes()
    tower(pixels(), torch.tensor(GRID))
    assert kept > 0 and fix.FIX.resident_tables(tower).resident_bytes() == kept


@pytest.mark.parametrize("layout", ["two towers", "one tower, two devices"])
def test_two_threads_no_cross_talk(layout):
    """Jobs on two threads at once, activations on different devices. With the tower shared, stock ops cast every
    weight to each call's input device, so one tower computes on cpu and on meta at the same time."""
    on_cpu = tiny_qwen3vl_tower()
    on_meta = offloaded_tower() if layout == "two towers" else on_cpu
    reference = tower_kit.outputs(on_cpu(pixels(), torch.tensor(GRID)))
    fix.hook_towers(on_cpu)
    if on_meta is not on_cpu:
        fix.hook_towers(on_meta)

    def cpu_call():
        return all(map(torch.equal, tower_kit.outputs(on_cpu(pixels(), torch.tensor(GRID))), reference))

    def meta_call():
        return all(t.device.type == "meta" for t in tower_kit.outputs(on_meta(pixels().to("meta"), torch.tensor(GRID))))

    assert failures_running_concurrently([cpu_call, meta_call], rounds=25) == []


def test_self_test_passes():
    checks = list(self_test(fix.FIX))
    assert [c.name.split(":")[0] for c in checks] == ["red", "green", "green"]
    assert all(check.passed for check in checks), checks
