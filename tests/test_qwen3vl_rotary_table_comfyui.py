"""qwen3vl_rotary_table on ComfyUI's real Qwen3-VL vision tower (tiny config; COMFYUI_PATH), on the core under test
and, through a subprocess, on the simulated 0.38-era core whose ``qwen35.py`` has the same rotary code.

The finding (docs/qwen3vl_rotary_table.md): ComfyUI's legacy loader moves only modules that own weights unless the
load is full, so the rotary module's ``inv_freq`` stays in CPU RAM and every call builds the rotary table there and
copies it to the compute device. Meta stands in for the compute device (ComfyUI's ops cast CPU weights to it).
"""

import pytest
import torch

from hotfix_testing.concurrency import failures_running_concurrently
from minimax_hotfix import registry as pack_registry
from minimax_hotfix.diagnostics import self_test
from minimax_hotfix.diagnostics.self_tests import qwen3vl_rotary_table as rotary_kit
from minimax_hotfix.diagnostics.self_tests.qwen3vl_pos_embed import outputs, tiny_pixels
from minimax_hotfix.diagnostics.tiny_qwen3vl import TINY_QWEN3VL_GRID, tiny_qwen3vl_tower
from minimax_hotfix.kernels.qwen3vl_pos_embed import computing_on, rotary_frequency_table
from minimax_hotfix.patches import qwen3vl_pos_embed as position_fix
from minimax_hotfix.patches import qwen3vl_rotary_table as fix

GRID = TINY_QWEN3VL_GRID
META = torch.device("meta")


pytestmark = pytest.mark.usefixtures("comfyui", "fresh_detection")


def loaded_through_comfyui(budget_bytes: int):
    """A tiny tower (in a holder, as in a CLIP model) loaded by ComfyUI's real ModelPatcher onto meta with
    ``budget_bytes`` of VRAM (0: full load), as the legacy partial loader does."""
    import comfy.model_patcher

    holder = torch.nn.Module()
    holder.visual = tiny_qwen3vl_tower()
    patcher = comfy.model_patcher.ModelPatcher(holder, load_device=META, offload_device=torch.device("cpu"))
    patcher.load(META, lowvram_model_memory=budget_bytes, full_load=budget_bytes == 0)
    return patcher, holder.visual


def table_copies_per_call(tower, calls=3):
    """The host-to-device copies (other than ComfyUI's own weight casts) of each of ``calls`` later calls."""
    pixels = tiny_pixels().to(META)
    tower(pixels, torch.tensor(GRID))  # first call: the fix makes its resident copy
    return [rotary_kit.copies_from_host(tower, lambda: tower(pixels, torch.tensor(GRID)))[1] for _ in range(calls)]


@pytest.mark.cores("0.38 Qwen3-VL", "0.39 era")
def test_detect_applies_on_this_comfyui():
    status = pack_registry.status(fix.FIX)
    assert status.state is pack_registry.State.NEEDED, status.reason
    assert "inv_freq" in status.reason


@pytest.mark.cores("0.38 Qwen3-VL", "0.39 era")
@pytest.mark.parametrize("attached", [
    pytest.param(("qwen3vl_pos_embed",), id="red: without the fix"),
    pytest.param(("qwen3vl_pos_embed", "qwen3vl_rotary_table"), id="green: with the fix",
                 marks=pytest.mark.fails_switched_off("qwen3vl_rotary_table", "{'cpu'} == {'meta'}",
                                                      cores=("0.38 Qwen3-VL", "0.39 era")))])
def test_partial_load_through_the_model_patcher(registry, attached):
    """Red: a real partial load leaves inv_freq in CPU RAM; each call builds the table there and copies it over.
    Green: built on the compute device, no copy; the loader's buffer untouched. The position-table fix is on in
    both runs, so what remains is this fix's alone."""
    registry(*(pack_registry.all_fixes()[fix_id] for fix_id in attached))
    patcher, tower = loaded_through_comfyui(budget_bytes=4096)
    left_behind = tower.rotary_pos_emb.inv_freq
    assert left_behind.device.type == "cpu"
    assert pack_registry.attach_fixes(patcher, "clip") == [  # as the pack's CLIP loader: MINIMAX_HOTFIX_DISABLE honoured
        fix_id for fix_id in attached if pack_registry.status(pack_registry.all_fixes()[fix_id]).state is pack_registry.State.NEEDED]
    patcher.inject_model()
    built_on = rotary_kit.tables_built_on(tower)
    copies = table_copies_per_call(tower)
    if "qwen3vl_rotary_table" in attached:
        assert set(built_on) == {"meta"} and copies == [0, 0, 0]
    else:
        assert set(built_on) == {"cpu"} and copies == [1, 1, 1]
    assert tower.rotary_pos_emb.inv_freq is left_behind
    patcher.eject_model()
    assert "forward" not in vars(tower.rotary_pos_emb)


def test_full_load_moves_the_buffer_and_the_fix_keeps_the_stock_path():
    patcher, tower = loaded_through_comfyui(budget_bytes=0)
    assert tower.rotary_pos_emb.inv_freq.device == META
    calls = []
    stock = tower.rotary_pos_emb.forward
    tower.rotary_pos_emb.forward = lambda seqlen: calls.append(seqlen) or stock(seqlen)
    fix.hook_towers(tower)
    # pos_embed is on meta too, whose stock interpolation needs data: only the rotary table is built here
    with computing_on(tower, META):
        table = tower.rotary_pos_emb(7)
    assert table.device == META and calls == [7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_on_one_device_outputs_bit_identical(dtype):
    tower = tiny_qwen3vl_tower(dtype)
    pixels = tiny_pixels().to(dtype)
    reference = outputs(tower(pixels, torch.tensor(GRID)))
    fix.hook_towers(tower)
    assert all(map(torch.equal, outputs(tower(pixels, torch.tensor(GRID))), reference))


def test_kernel_equals_comfyui_rotary_module_bit_for_bit():
    rotary = tiny_qwen3vl_tower().rotary_pos_emb
    for seqlen in (1, 7, 64, 1000):
        assert torch.equal(rotary_frequency_table(rotary.inv_freq, seqlen), rotary(seqlen))


def test_off_switch(monkeypatch):
    monkeypatch.setenv(pack_registry.DISABLE_ENV, fix.FIX.id)
    assert pack_registry.status(fix.FIX).state is pack_registry.State.DISABLED


def test_survives_clone_and_reinjection():
    import comfy.model_patcher

    holder = torch.nn.Module()
    holder.visual = tiny_qwen3vl_tower()
    rotary_kit.partially_loaded(holder.visual, META)
    position_fix.hook_towers(holder.visual)
    patcher = comfy.model_patcher.ModelPatcher(holder, load_device=META, offload_device=torch.device("cpu"))
    assert "qwen3vl_rotary_table" in pack_registry.attach_fixes(patcher, "clip")
    clone = patcher.clone()
    built_on = rotary_kit.tables_built_on(holder.visual)
    for each in (patcher, clone):
        each.inject_model()
        holder.visual(tiny_pixels().to(META), torch.tensor(GRID))
        each.eject_model()
        holder.visual(tiny_pixels().to(META), torch.tensor(GRID))
    assert built_on == ["meta", "cpu", "meta", "cpu"]


def test_one_tower_two_devices_on_two_threads():
    """One tower with CPU weights computing on cpu and on meta at once: a device kept on the module instead of the
    call's own frame would build one thread's table on the other's device (and fail copying meta to cpu)."""
    tower = tiny_qwen3vl_tower()
    reference = outputs(tower(tiny_pixels(), torch.tensor(GRID)))
    fix.hook_towers(tower)

    def cpu_call():
        return all(map(torch.equal, outputs(tower(tiny_pixels(), torch.tensor(GRID))), reference))

    def meta_call():
        return all(t.device == META for t in outputs(tower(tiny_pixels().to(META), torch.tensor(GRID))))

    assert failures_running_concurrently([cpu_call, meta_call], rounds=25) == []


def test_self_test_passes():
    checks = list(self_test(fix.FIX))
    assert [c.name.split(":")[0] for c in checks] == ["red", "green", "green"]  # the doctor prints red first
    assert all(check.passed for check in checks), checks
