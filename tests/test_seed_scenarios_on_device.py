"""The seed scenarios end to end on the simulated accelerator (tests/simulated_device): a real ComfyUI server
started without ``--cpu`` adopts the device, the bundled workflow is queued through /prompt and awaited on
/history with the synthetic models (tests/synthetic_models.py), and ComfyUI's own memory manager decides what it
loads at each budget; outputs (the probe's decoded tensors) are compared with an all-CPU (``--cpu``) run of the same
graph.

Budgets: ComfyUI keeps ``minimum_inference_memory()`` free (0.8 GiB plus the 400 MiB reserve: RESERVE_MB) before
it loads weights, so the device's total is RESERVE_MB plus what may be resident: "full" (every model fits),
"partial" (part of the video VAE resident: VAE_PARTIAL_MB), "smallest" (nothing resident: every weight streamed per
forward, the least that still runs). One server per core and loaders serves all three budgets: the total is changed
through the device's ``/simulated_device`` route and the models unloaded through ``/free`` between prompts.

Red controls run in a server *without* the pack (stock loaders: tools/swap_loaders.py --reverse output): in a
server with the pack, the process-wide ``ck_rope_device`` fix rescues a stock VAE too.

The H3 audio output is reported, not compared: the synthetic audio VAE is ill-conditioned (a 4e-6 change of its
latent moves its output by 0.015 on the CPU alone), so the sampled latent's last-bit differences are amplified.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

PACK_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PACK_ROOT / "tools"))
import scenario_table
import simulated_cores
import swap_loaders
import synthetic_models
from comfyui_server import SimulatedDevice, comfyui_with_pack, finished_prompt, http
from workflow_api import FRONTEND_ONLY, load
from workflow_prompts import FIX_LOG, MUSIC3, h3_prompt, music3_prompt

pytestmark = pytest.mark.skipif(not simulated_cores.available(), reason="needs ../shared/comfyui (simulated cores)")

RESERVE_MB = 0.8 * 1024 + 400
VAE_PARTIAL_MB = 1.5  # of the tiny video VAE's 2.89 MB (float32): its decoder split between device and CPU
BUDGETS = {"full": RESERVE_MB + 256, "partial": RESERVE_MB + VAE_PARTIAL_MB, "smallest": RESERVE_MB}
H3_TEXT_TO_VIDEO = PACK_ROOT / "workflows" / "minimax_h3_text_to_video.json"
COMPARED = ("sampled.latent_0", "sampled.images")  # the audio: see the module docstring
LOAD_LINE = re.compile(r"loaded (completely|partially); .*?([\d.]+) MB loaded")
MIXED = "Expected all tensors to be on the same device, but found at least two devices"


@pytest.fixture(scope="module")
def models(tmp_path_factory, comfyui):
    folder = tmp_path_factory.mktemp("device_models")
    synthetic_models.write_models(folder)
    return folder


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    """``server(core, pack, device)``: (url, object_info, base) of a running ComfyUI, started once per key."""
    cores, running = {}, {}
    with contextlib.ExitStack() as stack:
        def server(core: str, pack: bool, device: SimulatedDevice | None):
            key = (core, pack, device)
            if key not in running:
                if core not in cores:
                    cores[core] = simulated_cores.build_core(core, tmp_path_factory.mktemp("core") / "ComfyUI")
                base = tmp_path_factory.mktemp("server")
                (base / "models").symlink_to(models, target_is_directory=True)
                started = time.monotonic()
                url, object_info = stack.enter_context(comfyui_with_pack(
                    cores[core], base, PACK_ROOT / "tests" / "comfyui_probe", options=("--cache-none",),
                    device=device, pack=pack))
                print(f"\nserver {core!r} pack={pack} device={device} ready in {time.monotonic() - started:.1f} s")
                running[key] = url, object_info, base
            return running[key]

        yield server


def error_of(entry: dict) -> str | None:
    """``node type: first line of the exception`` of a failed run, None when it completed."""
    if entry["status"]["status_str"] == "success":
        return None
    ((_, data),) = [message for message in entry["status"]["messages"] if message[0] == "execution_error"]
    return f"{data['node_type']}: {data['exception_message'].strip().splitlines()[0]}"


def run(server, workflow: dict, tag: str, total_mb: float | None = None, make_prompt=h3_prompt,
        probes=("sampled",), current_device: int = 0) -> dict:
    """Queues ``make_prompt(workflow)`` (H3: tiny canvas, the text encoder stand-in, probes) on ``server`` at
    ``total_mb`` with models on ``npu:current_device``; returns its outcome, the probe tensors, the loads and fix
    lines of its log, its host-to-device copies."""
    url, object_info, base = server
    log = base / "comfyui.log"
    http(url + "/free", {"unload_models": True, "free_memory": True})
    if total_mb is not None:
        http(url + "/simulated_device", {"total_mb": total_mb, "current_device": current_device,
                                         "reset_counters": True})
    start = len(log.read_text())
    workflow = copy.deepcopy(workflow)
    # a server without the pack lacks its status node (a display, linked to nothing): the user deletes it
    workflow["nodes"] = [node for node in workflow["nodes"] if node["type"] in object_info
                         or node["type"] in FRONTEND_ONLY or node["type"] == "CLIPLoader"]
    prompt = make_prompt(workflow, object_info, tag)
    entry = finished_prompt(url, prompt, base)
    text = log.read_text()[start:]
    tensors = {f"{probe}.{name}": value for probe in probes
               if (path := base / "output" / f"{tag}_{probe}.safetensors").exists()
               for name, value in load_file(path).items()}
    device = json.loads(http(url + "/simulated_device")[1]) if total_mb is not None else None
    return {"error": error_of(entry), "tensors": tensors,
            "loads": [f"{float(mb):.2f}{'' if kind == 'completely' else ' (partial)'}"
                      for kind, mb in LOAD_LINE.findall(text)],
            "fix_lines": [match.group(0) for line in text.splitlines() if (match := FIX_LOG.search(line))],
            "h2d": sum(nbytes for _, nbytes in device["host_to_device"].values()) if device else None}


def hook_counts(lines: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in lines:
        found = re.search(r"MiniMax Hotfix: (\w+) hooked (\d+) module\(s\) of (\w+)", line)
        if found:
            key = f"{found.group(1)}@{found.group(3)}"
            counts[key] = counts.get(key, 0) + int(found.group(2))
    return counts


def max_abs_diff(tensors: dict, reference: dict, compared=COMPARED) -> float | None:
    if not tensors:
        return None
    return max((tensors[name] - reference[name]).abs().max().item() for name in compared)


def record(scenario, core, budget, loaders, result, reference, compared=COMPARED):
    diff = max_abs_diff(result["tensors"], reference, compared)
    row = {"scenario": scenario, "core": core, "budget": budget, "loaders": loaders,
           "outcome": "completed" if result["error"] is None else f"error: {result['error'][:150]}",
           "loads": "/".join(result["loads"]), "hooks": ", ".join(f"{k}={v}" for k, v in
                                                                  hook_counts(result["fix_lines"]).items()) or "-",
           "max_abs_diff": "-" if diff is None else f"{diff:.1e}",
           "h2d": "-" if result["h2d"] is None else f"{result['h2d'] / 2**20:.2f} MiB"}
    scenario_table.ROWS.append(row)
    print(" | ".join(str(value) for value in row.values()))
    return diff


def workflows(path: Path = H3_TEXT_TO_VIDEO) -> tuple[dict, dict]:
    pack = load(path)
    stock = copy.deepcopy(pack)
    assert swap_loaders.swap(stock, reverse=True)
    return pack, stock


REFERENCE_CORE = "0.36/0.37 VAE"  # on the CPU the cores' vae.py compute the same (.to(query.device) is a no-op)


@pytest.fixture(scope="module")
def h3_reference(servers):
    """The all-CPU (``--cpu``) run of the seed 000 graph, the reference of every H3 device run."""
    reference = run(servers(REFERENCE_CORE, True, None), workflows()[0], "cpu_reference")
    assert reference["error"] is None, reference["error"]
    return reference


@pytest.mark.parametrize("core", ["0.36/0.37 VAE", "fixed VAE"])
def test_seed_000_h3_vae_decode_under_partial_loads(core, servers, h3_reference):
    pack_workflow, stock_workflow = workflows()
    reference = h3_reference
    device = SimulatedDevice(total_mb=BUDGETS["full"])
    slug = core.replace("/", "_").replace(" ", "_").replace(".", "")
    for budget, total_mb in BUDGETS.items():
        stock = run(servers(core, False, device), stock_workflow, f"{slug}_stock_{budget}", total_mb)
        pack = run(servers(core, True, device), pack_workflow, f"{slug}_pack_{budget}", total_mb)
        stock_diff = record("seed 000 H3 t2v", core, budget, "stock (server without the pack)", stock,
                            reference["tensors"])
        pack_diff = record("seed 000 H3 t2v", core, budget, "pack", pack, reference["tensors"])
        assert pack["error"] is None, pack["error"]
        assert pack_diff <= 1e-4
        if core == "0.36/0.37 VAE":
            assert hook_counts(pack["fix_lines"]).get("vae_qk_norm_scale@MiniMaxH3VideoVAE", 0) > 0
        if core == "fixed VAE":
            assert stock["error"] is None and stock_diff <= 1e-4, stock["error"]
        elif budget != "full":
            assert stock["error"].startswith(f"VAEDecode: {MIXED}, npu:0 and cpu!"), stock["error"]
            assert "rms_rope" in stock["error"], stock["error"]
    startup_status = re.search(r"MiniMax Hotfix: vae_qk_norm_scale: ([\w ]+)",
                               (servers(core, True, device)[2] / "comfyui.log").read_text()).group(1).strip()
    print(f"{core}: vae_qk_norm_scale: {startup_status}")
    assert startup_status == ("fixed upstream" if core == "fixed VAE" else "needed")


def test_multi_device_h3_on_npu1(servers, h3_reference):
    """The seed 000 graph with its models on ``npu:1`` (ComfyUI's current device switched through the device's
    route) at the partial budget: every fix still attached after ComfyUI's clones, the pack's run equal to the CPU's,
    the stock run failing as on ``npu:0`` but naming ``npu:1``."""
    core = "0.36/0.37 VAE"
    pack_workflow, stock_workflow = workflows()
    reference = h3_reference
    device = SimulatedDevice(total_mb=BUDGETS["full"])
    stock = run(servers(core, False, device), stock_workflow, "npu1_stock", BUDGETS["partial"], current_device=1)
    pack = run(servers(core, True, device), pack_workflow, "npu1_pack", BUDGETS["partial"], current_device=1)
    record("multi-device (models on npu:1)", core, "partial", "stock (server without the pack)", stock,
           reference["tensors"])
    diff = record("multi-device (models on npu:1)", core, "partial", "pack", pack, reference["tensors"])
    assert stock["error"].startswith(f"VAEDecode: {MIXED}, npu:1 and cpu!"), stock["error"]
    assert pack["error"] is None and diff <= 1e-4, pack["error"]
    assert hook_counts(pack["fix_lines"]).get("vae_qk_norm_scale@MiniMaxH3VideoVAE", 0) > 0


MUSIC3_BUDGETS = {"full": RESERVE_MB + 512, "partial": RESERVE_MB + 100, "smallest": RESERVE_MB}
MUSIC3_PROBES = ("encoded", "zeroed")
MUSIC3_COMPARED = ("encoded.conditioning", "encoded.audio", "zeroed.conditioning")


def test_seed_002_music3_on_the_device(servers):
    """Music 3 (text encoder, AR loop, DAV decode: what a CPU can run, see test_workflow_runs) on the device at three
    budgets, pack and stock loaders, equal outputs and equal to the CPU's. ComfyUI loads the Music 3 text encoder
    (12.27 MB) and DAV (206.60 MB) fully whatever the budget (their loads are forced full: ``disable_offload``), so
    no budget splits them; the model ComfyUI would split, the 2.46 B parameter DiT, does not run on a CPU. CUDA graph
    capture (the Music 3 graph fixes) needs CUDA: not run here (the graph fix hooks 0 modules on this device). The
    Music 3 files are 0.33.0's in this core (its overlay is the H3 VAE only), so the servers of seed 000 serve it."""
    core = "0.36/0.37 VAE"
    pack_workflow, stock_workflow = workflows(MUSIC3)
    reference = run(servers(core, True, None), pack_workflow, "music3_cpu", make_prompt=music3_prompt,
                    probes=MUSIC3_PROBES)
    assert reference["error"] is None, reference["error"]
    device = SimulatedDevice(total_mb=BUDGETS["full"])
    for budget, total_mb in MUSIC3_BUDGETS.items():
        results = {}
        for loaders, pack in (("stock (server without the pack)", False), ("pack", True)):
            result = run(servers(core, pack, device), pack_workflow if pack else stock_workflow,
                         f"music3_{'pack' if pack else 'stock'}_{budget}", total_mb, make_prompt=music3_prompt,
                         probes=MUSIC3_PROBES)
            diff = record("seed 002 Music 3", core, budget, loaders, result, reference["tensors"], MUSIC3_COMPARED)
            assert result["error"] is None and diff <= 1e-4, result["error"]
            assert result["loads"] and not any("partial" in load for load in result["loads"]), result["loads"]
            results[loaders] = result["tensors"]
        stock_tensors, pack_tensors = results.values()
        assert all(torch.equal(stock_tensors[name], pack_tensors[name]) for name in MUSIC3_COMPARED)
