"""The seed scenarios under ComfyUI's default memory manager, dynamic VRAM (``ModelPatcherDynamic`` over comfy-aimdo,
on by default on NVIDIA), end to end on the simulated accelerator: servers started with ``--enable-dynamic-vram``
load the stand-in comfy-aimdo (tests/simulated_device/dynamic_vram), whose vbars keep weights resident on the
device up to the budget (``vbar_mb``: the scenario's resident MB) and answer "out of VRAM" past it, so ComfyUI
streams the rest through its cast path as on a real card. Stock (server without the pack) vs pack vs the all-CPU
run, at the scenario's budgets (three: everything resident, a split, nothing resident; Music 3 one, see below); the ``vbar`` column of the
scenario table gives the MiB faulted in / found resident / refused per prompt. Models are unloaded between prompts
(``--cache-none``), so every prompt goes through ComfyUI's dynamic load and unload cycle with the fixes attached.

Findings the assertions hold:
* seed 000: the dynamic loader moves every buffer to the device (``ModelPatcherDynamic.load``), so the stock H3 VAE
  decode does not crash at any budget, whatever part of its weights is resident; the pack's hooks attach and its
  output is the CPU's.
* seed 004: the dequantize fallback is still bypassed (the stock run stops at the DiT's first int8 layer with the
  MPS error, as under the legacy loader); the pack's run equals the CPU's.
* Music 3: its text encoder runs on the CPU here (``--force-fp32``: the placement of Comfy-Org/ComfyUI#15607, whose
  crash needs a CUDA build of torch asking CUDA about that CPU device: tests/test_cpu_device_cuda_query.py), and the
  DAV forces full loads (``disable_offload``), for which ComfyUI keeps its plain ModelPatcher even under dynamic
  VRAM: neither model touches a vbar, the outputs are the CPU's. CUDA graphs need CUDA: the graph fixes hook nothing
  here.
"""

from __future__ import annotations

import pytest

from hotfix_testing import simulated_cores
from hotfix_testing.comfyui_server import SimulatedDevice, simulated_accelerator_module
from hotfix_testing.seed_scenarios import budgets, hook_counts, music3_stock_and_pack, named, record, run, workflows

MPS_INT_MM_ERROR = simulated_accelerator_module().MPS_INT_MM_ERROR

pytestmark = pytest.mark.skipif(not simulated_cores.available(), reason="needs ../shared/comfyui (simulated cores)")

def faults(result: dict) -> tuple[int, int, int]:
    """Bytes faulted in, found resident, refused (out of VRAM) at the prompt's vbar faults."""
    counters = result["vbar"]["counters"]
    return tuple(counters[name][1] for name in ("faulted_in", "resident", "out_of_vram"))

def assert_budget_splits_the_weights(budget: str, result: dict) -> None:
    """Everything resident at "full", nothing at "smallest", some of each in between: the stand-in's budget, decided
    fault by fault as ComfyUI asks."""
    assert result["loader"] == "dynamic", result["loader"]
    faulted_in, _, refused = faults(result)
    if budget == "full":
        assert faulted_in > 0 and refused == 0, result["vbar"]
    elif budget == "smallest":
        assert faulted_in == 0 and refused > 0, result["vbar"]
    else:
        assert faulted_in > 0 and refused > 0, result["vbar"]

def test_seed_000_h3_under_dynamic_vram(device_servers, h3_reference):
    scenario = named("seed 000 H3 t2v, dynamic VRAM")
    (core,) = scenario.cores
    pack_workflow, stock_workflow = workflows(scenario.workflow)
    device = SimulatedDevice(total_mb=budgets(scenario)["full"], dynamic_vram=True)
    for budget, total_mb in budgets(scenario).items():
        stock = run(device_servers(core, False, device), stock_workflow, f"dynamic_stock_{budget}", total_mb)
        pack = run(device_servers(core, True, device), pack_workflow, f"dynamic_pack_{budget}", total_mb)
        stock_diff = record(scenario.name, core, budget, "stock (server without the pack)", stock,
                            h3_reference["tensors"])
        pack_diff = record(scenario.name, core, budget, "pack", pack, h3_reference["tensors"])
        assert stock["error"] is None and stock_diff <= 1e-4, stock["error"]
        assert pack["error"] is None and pack_diff <= 1e-4, pack["error"]
        assert hook_counts(pack["fix_lines"]).get(scenario.fix, 0) > 0
        for result in (stock, pack):
            assert_budget_splits_the_weights(budget, result)

def test_seed_004_h3_int8_under_dynamic_vram(device_servers, device_int8_models, h3_int8_reference):
    scenario = named("seed 004 H3 int8 without _int_mm, dynamic VRAM")
    (core,) = scenario.cores
    pack_workflow, stock_workflow = workflows(scenario.workflow)
    device = SimulatedDevice(total_mb=budgets(scenario)["full"], int_mm=scenario.int_mm, dynamic_vram=True)
    int8_models = device_int8_models[0]
    for budget, total_mb in budgets(scenario).items():
        stock = run(device_servers(core, False, device, int8_models), stock_workflow, f"dynamic_int8_stock_{budget}",
                    total_mb)
        pack = run(device_servers(core, True, device, int8_models), pack_workflow, f"dynamic_int8_pack_{budget}",
                   total_mb)
        record(scenario.name, core, budget, "stock (server without the pack)", stock, h3_int8_reference["tensors"])
        pack_diff = record(scenario.name, core, budget, "pack", pack, h3_int8_reference["tensors"])
        assert stock["error"].startswith(f"SamplerCustomAdvanced: {MPS_INT_MM_ERROR}"), stock["error"]
        assert pack["error"] is None and pack_diff <= 1e-4, pack["error"]
        assert hook_counts(pack["fix_lines"]).get(scenario.fix, 0) > 0
        assert_budget_splits_the_weights(budget, pack)

def test_seed_002_music3_under_dynamic_vram(device_servers, music3_reference):
    scenario = named("seed 002 Music 3, dynamic VRAM")
    device = SimulatedDevice(total_mb=budgets(named("seed 000 H3 t2v, dynamic VRAM"))["full"], dynamic_vram=True)
    runs = music3_stock_and_pack(device_servers, scenario, device, music3_reference, "dynamic_music3")
    for result in (result for results in runs.values() for result in results.values()):
        # neither model goes through a vbar: the text encoder computes on the CPU (ComfyUI's plain patcher for
        # a CPU load device) and the DAV forces full loads (disable_offload: a plain ModelPatcher even under
        # dynamic VRAM), so the loads are the legacy loader's, whole, even with no budget for the vbar
        assert result["loader"] == "dynamic" and faults(result) == (0, 0, 0), result["vbar"]
