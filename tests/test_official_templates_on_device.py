"""ComfyUI's official MiniMax templates (the comfyui_workflow_templates_json package: OFFICIAL_TEMPLATES in
tests/hotfix_testing/workflow_api.py) end to end on the simulated accelerator, as the seed scenarios run
(tests/test_seed_scenarios_on_device.py): the template as shipped (stock loaders, inside its subgraph) in a server
without the pack, the swap tool's output (tools/swap_loaders.py) in a server with it, both at the partial budget,
and an all-CPU run of the swapped template as the reference. The servers are seed 000's (session fixtures), the
synthetic models carry the templates' file names, each input image is a small stand-in under the template's name.

Each prompt is what the frontend queues for the template (subgraphs lowered), lowered like the bundled workflows'
(tests/hotfix_testing/workflow_prompts.py): a 64x64 canvas of 5 frames, 2 steps, a 0.2 s song; probes save the tensors.
"""

from __future__ import annotations

import pytest

from hotfix_testing import simulated_cores
from hotfix_testing.comfyui_server import SimulatedDevice
from hotfix_testing.seed_scenarios import (
    MIXED,
    REFERENCE_CORE,
    budgets,
    hook_counts,
    named,
    record,
    run,
    template_workflows,
)
from hotfix_testing.workflow_api import OFFICIAL_TEMPLATES

pytestmark = pytest.mark.skipif(not simulated_cores.available(), reason="needs ../shared/comfyui (simulated cores)")

H3_TEMPLATES = [name for name in OFFICIAL_TEMPLATES if name.startswith("H3 ")]
H3_FIX = named("seed 000 H3 t2v").fix


def seed_000_device() -> SimulatedDevice:
    return SimulatedDevice(total_mb=budgets(named("seed 000 H3 t2v"))["full"])  # seed 000's servers


@pytest.mark.parametrize("template", H3_TEMPLATES)
def test_official_h3_template_at_the_partial_budget(template, device_servers):
    stem = OFFICIAL_TEMPLATES[template]
    pack_workflow, stock_workflow = template_workflows(stem)
    scenario = f"template {stem}"
    total_mb = budgets(named("seed 000 H3 t2v"))["partial"]
    reference = run(device_servers(REFERENCE_CORE, True, None), pack_workflow, f"{stem}_cpu")
    assert reference["error"] is None, reference["error"]
    stock = run(device_servers(REFERENCE_CORE, False, seed_000_device()), stock_workflow, f"{stem}_stock", total_mb)
    pack = run(device_servers(REFERENCE_CORE, True, seed_000_device()), pack_workflow, f"{stem}_pack", total_mb)
    record(scenario, REFERENCE_CORE, "partial", "stock (as shipped, server without the pack)", stock,
           reference["tensors"])
    diff = record(scenario, REFERENCE_CORE, "partial", "pack (swap tool's output)", pack, reference["tensors"])
    assert stock["error"].startswith(f"VAEDecode: {MIXED}, npu:0 and cpu!"), stock["error"]
    assert "rms_rope" in stock["error"], stock["error"]
    assert pack["error"] is None, pack["error"]
    assert diff <= 1e-4
    assert hook_counts(pack["fix_lines"]).get(H3_FIX, 0) > 0


def test_official_music3_template_at_the_partial_budget(device_servers):
    """Music 3 as seed 002 runs it: both loaders complete at the partial budget, equal to the CPU's."""
    seed_002 = named("seed 002 Music 3")
    stem = OFFICIAL_TEMPLATES["Music 3"]
    pack_workflow, stock_workflow = template_workflows(stem)
    options = {"make_prompt": seed_002.make_prompt, "probes": seed_002.probes}
    reference = run(device_servers(REFERENCE_CORE, True, None), pack_workflow, f"{stem}_cpu", **options)
    assert reference["error"] is None, reference["error"]
    total_mb = budgets(seed_002)["partial"]
    for loaders, pack, workflow in (("stock (as shipped, server without the pack)", False, stock_workflow),
                                    ("pack (swap tool's output)", True, pack_workflow)):
        result = run(device_servers(REFERENCE_CORE, pack, seed_000_device()), workflow,
                     f"{stem}_{'pack' if pack else 'stock'}", total_mb, **options)
        diff = record(f"template {stem}", REFERENCE_CORE, "partial", loaders, result, reference["tensors"],
                      seed_002.compared)
        assert result["error"] is None and diff <= 1e-4, result["error"]
