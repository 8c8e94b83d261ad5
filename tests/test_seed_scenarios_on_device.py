"""The seed scenarios end to end on the simulated accelerator (tests/simulated_device): a real ComfyUI server
started without ``--cpu`` adopts the device, the bundled workflow is queued through /prompt and awaited on
/history with the synthetic models (tests/hotfix_testing/synthetic_models.py), and ComfyUI's own memory manager decides what it
loads at each budget; outputs (the probe's decoded tensors) are compared with an all-CPU (``--cpu``) run of the same
graph.

Budgets: ComfyUI keeps ``minimum_inference_memory()`` free (0.8 GiB plus the 400 MiB reserve: RESERVE_MB) before
it loads weights, so the device's total is RESERVE_MB plus what may be resident: "full" (every model fits),
"partial" (part of the video VAE resident; seed 004: part of the int8 DiT and of the int8 video VAE), "smallest"
(nothing resident: every weight streamed per forward, the least that still runs), each scenario's resident MB in
tests/hotfix_testing/seed_scenarios.py, the one list that the GPU check (benchmarks/gpu_check.py) runs too. One server per core
and loaders serves all three budgets: the total is changed through the device's ``/simulated_device`` route and the
models unloaded through ``/free`` between prompts.

Red controls run in a server *without* the pack (stock loaders: tools/swap_loaders.py --reverse output): in a
server with the pack, the process-wide ``ck_rope_device`` fix rescues a stock VAE too.

The H3 audio decoded from the sampled latent is not compared: the synthetic audio VAE is ill-conditioned (a 4e-6
change of its latent moves its output by 0.015 on the CPU alone), so the sampled latent's last-bit differences are
amplified. The audio VAE is compared on a fixed latent instead (``TestProbeFixedLatent``, the probe ``fixed``).
"""

from __future__ import annotations

import pytest

from hotfix_testing import simulated_cores
from hotfix_testing.comfyui_server import SimulatedDevice, simulated_accelerator_module
from hotfix_testing.seed_scenarios import (
    MIXED,
    budgets,
    fix_state,
    hook_counts,
    music3_stock_and_pack,
    named,
    record,
    run,
    workflows,
)

MPS_INT_MM_ERROR = simulated_accelerator_module().MPS_INT_MM_ERROR

pytestmark = pytest.mark.skipif(not simulated_cores.available(), reason="needs ../shared/comfyui (simulated cores)")

H3_DIT = "MiniMaxH3"  # ComfyUI's model class of the H3 DiT, as the fixes' log lines name it


def slug(core: str) -> str:
    return core.replace("/", "_").replace(" ", "_").replace(".", "")


@pytest.mark.parametrize("core", named("seed 000 H3 t2v").cores)
def test_seed_000_h3_vae_decode_under_partial_loads(core, device_servers, h3_reference):
    scenario = named("seed 000 H3 t2v")
    pack_workflow, stock_workflow = workflows(scenario.workflow)
    reference = h3_reference
    device = SimulatedDevice(total_mb=budgets(scenario)["full"])
    fix, model = scenario.fix.split("@")
    for budget, total_mb in budgets(scenario).items():
        stock = run(device_servers(core, False, device), stock_workflow, f"{slug(core)}_stock_{budget}", total_mb)
        pack = run(device_servers(core, True, device), pack_workflow, f"{slug(core)}_pack_{budget}", total_mb)
        stock_diff = record(scenario.name, core, budget, "stock (server without the pack)", stock, reference["tensors"])
        pack_diff = record(scenario.name, core, budget, "pack", pack, reference["tensors"])
        assert pack["error"] is None, pack["error"]
        assert pack_diff <= 1e-4
        if core == "0.36/0.37 VAE":
            assert hook_counts(pack["fix_lines"]).get(scenario.fix, 0) > 0
        if core == "fixed VAE":
            assert stock["error"] is None and stock_diff <= 1e-4, stock["error"]
        elif budget != "full":
            assert stock["error"].startswith(f"VAEDecode: {MIXED}, npu:0 and cpu!"), stock["error"]
            assert "rms_rope" in stock["error"], stock["error"]
    startup_status = fix_state(device_servers(core, True, device)[2], fix)
    print(f"{core}: {fix} ({model}): {startup_status}")
    assert startup_status == ("fixed upstream" if core == "fixed VAE" else "needed")


@pytest.mark.parametrize("core", named("seed 004 H3 int8 without _int_mm").cores)
def test_seed_004_h3_int8_without_int_mm(core, device_servers, device_int8_models, h3_int8_reference):
    """The H3 graph with the int8 ConvRot DiT and video VAE on a device without ``torch._int_mm`` (MPS): the stock
    loaders stop where the core hands an int8 layer to ``_int_mm`` (0.33.0: the DiT's first step; "fixed int8":
    VAE Decode, since nothing marks the VAE's layers), the pack's run equals the CPU's with the dequantized weights."""
    scenario = named("seed 004 H3 int8 without _int_mm")
    pack_workflow, stock_workflow = workflows(scenario.workflow)
    device = SimulatedDevice(total_mb=budgets(scenario)["full"], int_mm=scenario.int_mm)
    int8_models = device_int8_models[0]
    failing_node = "SamplerCustomAdvanced" if core == "0.33.0" else "VAEDecode"
    fix, _ = scenario.fix.split("@")
    for budget, total_mb in budgets(scenario).items():
        stock = run(device_servers(core, False, device, int8_models), stock_workflow,
                    f"int8_{slug(core)}_stock_{budget}", total_mb)
        pack = run(device_servers(core, True, device, int8_models), pack_workflow,
                   f"int8_{slug(core)}_pack_{budget}", total_mb)
        record(scenario.name, core, budget, "stock (server without the pack)", stock, h3_int8_reference["tensors"])
        pack_diff = record(scenario.name, core, budget, "pack", pack, h3_int8_reference["tensors"])
        assert stock["error"].startswith(f"{failing_node}: {MPS_INT_MM_ERROR}"), stock["error"]
        assert pack["error"] is None, pack["error"]
        assert pack_diff <= 1e-4
        hooks = hook_counts(pack["fix_lines"])
        assert hooks.get(scenario.fix, 0) > 0, hooks
        # the DiT's layers (fc2 through linear_input_act) need it only where the core does not dequantize them
        assert (hooks.get(f"{fix}@{H3_DIT}", 0) > 0) is (core == "0.33.0"), hooks
        if budget == "partial":
            assert any("partial" in load for load in pack["loads"]), pack["loads"]
    assert fix_state(device_servers(core, True, device, int8_models)[2], fix) == "needed"


def test_multi_device_h3_on_npu1(device_servers, h3_reference):
    """The seed 000 graph with its models on ``npu:1`` (ComfyUI's current device switched through the device's
    route) at the partial budget: every fix still attached after ComfyUI's clones, the pack's run equal to the CPU's,
    the stock run failing as on ``npu:0`` but naming ``npu:1``."""
    scenario = named("multi-device (models on device 1)")
    (core,) = scenario.cores
    pack_workflow, stock_workflow = workflows(scenario.workflow)
    reference = h3_reference
    device = SimulatedDevice(total_mb=budgets(named("seed 000 H3 t2v"))["full"])  # seed 000's servers
    ((budget, total_mb),) = budgets(scenario).items()
    index = scenario.device_index
    stock = run(device_servers(core, False, device), stock_workflow, "npu1_stock", total_mb, current_device=index)
    pack = run(device_servers(core, True, device), pack_workflow, "npu1_pack", total_mb, current_device=index)
    record(scenario.name, core, budget, "stock (server without the pack)", stock, reference["tensors"])
    diff = record(scenario.name, core, budget, "pack", pack, reference["tensors"])
    assert stock["error"].startswith(f"VAEDecode: {MIXED}, npu:{index} and cpu!"), stock["error"]
    assert pack["error"] is None and diff <= 1e-4, pack["error"]
    assert hook_counts(pack["fix_lines"]).get(scenario.fix, 0) > 0


def test_multi_device_h3_split_over_two_devices(device_servers, h3_reference):
    """The seed 000 graph with the video VAE put on ``npu:1`` by ComfyUI's own Select VAE Device (a deep clone of
    the VAE's patcher there) while the DiT computes on ``npu:0``, at the partial budget on both devices: the fix still
    attached to the clone, the pack's run equal to the CPU's, the stock run failing at VAE Decode on ``npu:1``."""
    scenario = named("multi-device (video VAE on device 1, DiT on device 0)")
    (core,) = scenario.cores
    pack_workflow, stock_workflow = workflows(scenario.workflow)
    device = SimulatedDevice(total_mb=budgets(named("seed 000 H3 t2v"))["full"])  # seed 000's servers
    ((budget, total_mb),) = budgets(scenario).items()
    stock = run(device_servers(core, False, device), stock_workflow, "split_stock", total_mb,
                make_prompt=scenario.make_prompt)
    pack = run(device_servers(core, True, device), pack_workflow, "split_pack", total_mb,
               make_prompt=scenario.make_prompt)
    record(scenario.name, core, budget, "stock (server without the pack)", stock, h3_reference["tensors"])
    diff = record(scenario.name, core, budget, "pack", pack, h3_reference["tensors"])
    assert stock["error"].startswith(f"VAEDecode: {MIXED}, npu:1 and cpu!"), stock["error"]
    assert pack["error"] is None and diff <= 1e-4, pack["error"]
    assert hook_counts(pack["fix_lines"]).get(scenario.fix, 0) > 0


def test_seed_002_music3_on_the_device(device_servers, music3_reference):
    """Music 3 (text encoder, AR loop, DAV decode: what a CPU can run, see test_workflow_runs) on the device at three
    budgets, pack and stock loaders, equal outputs and equal to the CPU's. ComfyUI loads the Music 3 text encoder
    (12.27 MB) and DAV (206.60 MB) fully whatever the budget (their loads are forced full: ``disable_offload``), so
    no budget splits them; the model ComfyUI would split, the 2.46 B parameter DiT, does not run on a CPU. CUDA graph
    capture (the Music 3 graph fixes) needs CUDA: not run here (the graph fix hooks 0 modules on this device). The
    Music 3 files are 0.33.0's in this core (its overlay is the H3 VAE only), so the servers of seed 000 serve it."""
    scenario = named("seed 002 Music 3")
    device = SimulatedDevice(total_mb=budgets(named("seed 000 H3 t2v"))["full"])  # seed 000's servers
    music3_stock_and_pack(device_servers, scenario, device, music3_reference, "music3")
