"""The end-to-end seed scenarios, defined once: the simulated-device tests (tests/test_seed_scenarios_on_device.py)
and the opt-in GPU check (benchmarks/gpu_check.py) both run this list, so the two cannot drift apart.

A budget is what ComfyUI may keep resident on the device, in MB, beyond the ``minimum_inference_memory()`` it keeps
free before it loads weights: the simulated device sets its total to that sum, the GPU check sets ``--reserve-vram``
so that the real free memory leaves that much.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file

from hotfix_testing import scenario_table
from hotfix_testing.comfyui_server import SimulatedDevice, finished_prompt, http, unload_models
from hotfix_testing.workflow_api import load, official_template, ui_to_api
from hotfix_testing.workflow_prompts import FIX_LOG, MUSIC3, h3_prompt, h3_prompt_video_vae_on_device_1, music3_prompt
from minimax_hotfix import swap_loaders

PACK_ROOT = Path(__file__).resolve().parents[2]
H3_TEXT_TO_VIDEO = PACK_ROOT / "workflows" / "MiniMax H3 text to video.json"
H3_PROBES = ("sampled", "fixed")
# the sampled audio is reported, not compared (tests/test_seed_scenarios_on_device.py): the audio VAE is compared on
# a fixed latent instead
H3_COMPARED = ("sampled.latent_0", "sampled.images", "fixed.audio")
LOAD_LINE = re.compile(r"loaded (completely|partially); .*?([\d.]+) MB loaded")
RESERVE_MB = 0.8 * 1024 + 400  # ComfyUI's minimum_inference_memory(): 0.8 GiB plus its 400 MiB reserve
MIXED = "Expected all tensors to be on the same device, but found at least two devices"  # a stock VAE's error
REFERENCE_CORE = "0.36/0.37 VAE"  # on the CPU the cores' vae.py compute the same (.to(query.device) is a no-op)
H3_RESIDENT_MB = {"full": 256, "partial": 1.5, "smallest": 0}  # 1.5 of the tiny video VAE's 2.89 MB (float32)
H3_INT8_RESIDENT_MB = {"full": 256, "partial": 3, "smallest": 0}  # splits the int8 DiT and the int8 video VAE


def without_ck_rope() -> "SimulatedDevice":
    """The device of the servers that show the stock H3 VAE's failure beside the pack (the known-error notice, server-
    side fixing): ``ck_rope_device`` off, since that process-wide fix rescues a stock VAE as well; the video VAE partly
    resident, the budget at which the stock VAE fails."""
    return SimulatedDevice(total_mb=RESERVE_MB + H3_RESIDENT_MB["partial"], switched_off="ck_rope_device")


@dataclass(frozen=True)
class Scenario:
    name: str
    test: str  # the simulated-device test that runs it
    workflow: Path
    cores: tuple[str, ...]  # the simulated cores it runs on
    resident_mb: dict[str, float]  # budget name -> MB resident beyond minimum_inference_memory()
    make_prompt: Callable[[dict, dict, str], dict]
    probes: tuple[str, ...] = H3_PROBES
    compared: tuple[str, ...] = H3_COMPARED
    device_index: int = 0  # models on device:index, while device:0 exists too
    devices: int = 1  # devices the graph itself computes on (make_prompt selects the others)
    fix: str | None = None  # "fix@model" that must hook more than 0 modules where the fix is needed
    int_mm: bool = True  # False: on a device without torch._int_mm (MPS), which only the simulated device can be
    splits: bool = True  # ComfyUI loads a model partially at the "partial" and "smallest" budgets
    # ComfyUI's loader on the device: "legacy" (ModelPatcher, ComfyUI's fallback where comfy-aimdo is off) or
    # "dynamic" (dynamic VRAM: ModelPatcherDynamic over comfy-aimdo, the default on NVIDIA; on the simulated device
    # over the stand-in comfy-aimdo, tests/simulated_device/dynamic_vram)
    loader: str = "legacy"

    @property
    def devices_needed(self) -> int:
        return max(self.device_index + 1, self.devices)


SCENARIOS = (
    Scenario("seed 000 H3 t2v", "test_seed_000_h3_vae_decode_under_partial_loads", H3_TEXT_TO_VIDEO,
             ("0.36/0.37 VAE", "fixed VAE"), H3_RESIDENT_MB, h3_prompt,
             fix="vae_qk_norm_scale@MiniMaxH3VideoVAE"),
    Scenario("multi-device (models on device 1)", "test_multi_device_h3_on_npu1", H3_TEXT_TO_VIDEO,
             ("0.36/0.37 VAE",), {"partial": H3_RESIDENT_MB["partial"]}, h3_prompt, device_index=1,
             fix="vae_qk_norm_scale@MiniMaxH3VideoVAE"),
    Scenario("multi-device (video VAE on device 1, DiT on device 0)", "test_multi_device_h3_split_over_two_devices",
             H3_TEXT_TO_VIDEO, ("0.36/0.37 VAE",), {"partial": H3_RESIDENT_MB["partial"]},
             h3_prompt_video_vae_on_device_1, devices=2, fix="vae_qk_norm_scale@MiniMaxH3VideoVAE"),
    Scenario("seed 004 H3 int8 without _int_mm", "test_seed_004_h3_int8_without_int_mm", H3_TEXT_TO_VIDEO,
             ("0.33.0", "fixed int8"), H3_INT8_RESIDENT_MB, h3_prompt, fix="int8_full_precision_mm@MiniMaxH3VideoVAE",
             int_mm=False),
    # ComfyUI loads the Music 3 text encoder and DAV fully whatever the budget (disable_offload)
    Scenario("seed 002 Music 3", "test_seed_002_music3_on_the_device", MUSIC3, ("0.36/0.37 VAE",),
             {"full": 512, "partial": 100, "smallest": 0}, music3_prompt, probes=("encoded", "zeroed"),
             compared=("encoded.conditioning", "encoded.audio", "zeroed.conditioning"), splits=False),
    # under dynamic VRAM (tests/test_dynamic_vram_on_device.py): the budget is what the vbars may keep resident
    Scenario("seed 000 H3 t2v, dynamic VRAM", "test_seed_000_h3_under_dynamic_vram", H3_TEXT_TO_VIDEO,
             ("0.36/0.37 VAE",), H3_RESIDENT_MB, h3_prompt, fix="vae_qk_norm_scale@MiniMaxH3VideoVAE",
             loader="dynamic"),
    Scenario("seed 004 H3 int8 without _int_mm, dynamic VRAM", "test_seed_004_h3_int8_under_dynamic_vram",
             H3_TEXT_TO_VIDEO, ("0.33.0",), H3_INT8_RESIDENT_MB, h3_prompt,
             fix="int8_full_precision_mm@MiniMaxH3VideoVAE", int_mm=False, loader="dynamic"),
    # one budget: neither Music 3 model goes through a vbar (whole loads at any budget), the least one shows it best
    Scenario("seed 002 Music 3, dynamic VRAM", "test_seed_002_music3_under_dynamic_vram", MUSIC3, ("0.36/0.37 VAE",),
             {"smallest": 0}, music3_prompt, probes=("encoded", "zeroed"),
             compared=("encoded.conditioning", "encoded.audio", "zeroed.conditioning"), splits=False,
             loader="dynamic"),
)


def named(name: str) -> Scenario:
    (scenario,) = [scenario for scenario in SCENARIOS if scenario.name == name]
    return scenario


def budgets(scenario: Scenario) -> dict[str, float]:
    """Budget name -> the simulated device's total (MB)."""
    return {budget: RESERVE_MB + resident for budget, resident in scenario.resident_mb.items()}


def error_of(entry: dict) -> str | None:
    """``node type: first line of the exception`` of a failed run, None when it completed."""
    if entry["status"]["status_str"] == "success":
        return None
    ((_, data),) = [message for message in entry["status"]["messages"] if message[0] == "execution_error"]
    return f"{data['node_type']}: {data['exception_message'].strip().splitlines()[0]}"


def without_missing_pack_nodes(workflow: dict, object_info: dict) -> dict:
    """``workflow`` as a user of a server without the pack queues it: its status node (a display, linked to
    nothing) deleted."""
    workflow = copy.deepcopy(workflow)
    workflow["nodes"] = [node for node in workflow["nodes"] if node["type"] in object_info
                         or not node["type"].startswith(swap_loaders.RULES["pack_node_prefix"])]
    return workflow


def loads_of(log_text: str) -> list[str]:
    """MB loaded per model in a log, in load order, "(partial)" where ComfyUI loaded it partially."""
    return [f"{float(mb):.2f}{'' if kind == 'completely' else ' (partial)'}" for kind, mb in LOAD_LINE.findall(log_text)]


def fix_lines_of(log_text: str) -> list[str]:
    return [match.group(0) for line in log_text.splitlines() if (match := FIX_LOG.search(line))]


def run(server, workflow: dict, tag: str, total_mb: float | None = None, make_prompt=h3_prompt,
        probes=H3_PROBES, current_device: int = 0, fresh: bool = True) -> dict:
    """Queues ``make_prompt(workflow)`` (H3: tiny canvas, the tiny real text encoder, probes) on ``server`` at
    ``total_mb`` with models on ``npu:current_device``; returns its outcome, the probe tensors, the loads and fix
    lines of its log, its host-to-device copies. ``fresh``: every model unloaded and ComfyUI's node cache cleared
    first; else the models and the node outputs of the last prompt stay, as between a user's two runs in a server
    that caches."""
    url, object_info, base = server
    log = base / "comfyui.log"
    if fresh:
        unload_models(url)
    if total_mb is not None:
        http(url + "/simulated_device", {"total_mb": total_mb, "current_device": current_device,
                                         "vbar_mb": total_mb - RESERVE_MB, "reset_counters": True})
    start = len(log.read_text())
    prompt = make_prompt(without_missing_pack_nodes(workflow, object_info), object_info, tag)
    entry = finished_prompt(url, prompt, base)
    text = log.read_text()[start:]
    tensors = {f"{probe}.{name}": value for probe in probes
               if (path := base / "output" / f"{tag}_{probe}.safetensors").exists()
               for name, value in load_file(path).items()}
    device = json.loads(http(url + "/simulated_device")[1]) if total_mb is not None else None
    return {"error": error_of(entry), "tensors": tensors, "loads": loads_of(text), "fix_lines": fix_lines_of(text),
            "h2d": sum(nbytes for _, nbytes in device["host_to_device"].values()) if device else None,
            "loader": loader_of(device), "vbar": device and device["dynamic_vram"]}


def loader_of(device: dict | None) -> str:
    """"dynamic" (ComfyUI's dynamic VRAM over the stand-in comfy-aimdo), "legacy", or "cpu" (a ``--cpu`` run)."""
    return "cpu" if device is None else "dynamic" if device["dynamic_vram"] else "legacy"


def vbar_summary(vbar: dict | None) -> str:
    """MiB the dynamic VRAM faults put on the device, found there, and were refused (streamed instead)."""
    if not vbar:
        return "-"
    counters = vbar["counters"]
    return "/".join(f"{counters[name][1] / 2**20:.2f}" for name in ("faulted_in", "resident", "out_of_vram"))


# Seed 001 (tests/test_h3_vision_tower_on_device.py; benchmarks/gpu_check.py): the H3 reference-to-video workflow's
# conditioning, its reference image through the real tiny text encoder's vision tower on the device, in the models
# folder of synthetic_models.write_vision_tower_models, in servers that keep their models between prompts
VISION_TOWER = "seed 001 H3 r2v vision tower"
H3_REFERENCE_TO_VIDEO = PACK_ROOT / "workflows" / "MiniMax H3 reference to video (Ref2VA).json"
# MB resident beyond minimum_inference_memory(): the 80.8 MB encoder whole; 14.4 MB of its layers (ComfyUI reserves a
# 55.6 MB offload buffer first, on the simulated device); none
VISION_TOWER_RESIDENT_MB = {"full": 256, "partial": 70, "smallest": 0}
# "match" scales the reference (ComfyUI's 768x768 example.png) down to the canvas's area: 384x384 (24 x 24 patches of
# 16 px), 768x768 (48 x 48), fewer than and as many as the position table's 2304 rows
VISION_TOWER_CANVASES = {"384x384": ((384, 384), 24 * 24), "768x768": ((1344, 768), 48 * 48)}
VISION_TOWER_PROMPTS = ("a red kite over the sea", "a blue boat in the rain")
VISION_TOWER_FIXES = {"qwen3vl_pos_embed", "qwen3vl_rotary_table"}


def vision_tower_graph(workflow: dict, object_info: dict, text: str, canvas: tuple[int, int], tag: str) -> dict:
    """The workflow as the frontend queues it, cut to the conditioning node's inputs, with a probe saving its output
    to ``<tag>.safetensors``."""
    prompt = ui_to_api(workflow, object_info)
    (conditioning,) = [key for key, node in prompt.items() if node["class_type"] == "MiniMaxH3ReferenceToVideo"]
    needed, todo = set(), [conditioning]
    while todo:
        key = todo.pop()
        if key not in needed:
            needed.add(key)
            todo += [value[0] for value in prompt[key]["inputs"].values() if isinstance(value, list)]
    prompt = {key: node for key, node in prompt.items() if key in needed}
    inputs = prompt[conditioning]["inputs"]
    inputs["prompt"], (inputs["width"], inputs["height"]) = text, canvas
    prompt["probe"] = {"class_type": "TestProbeSaveTensors",
                       "inputs": {"filename": tag, "conditioning": [conditioning, 0]}}
    return prompt


def run_vision_tower(server, workflow: dict, text: str, canvas: str, tag: str, counters: bool = False) -> dict:
    """Queues ``vision_tower_graph`` on ``server`` with a canvas of VISION_TOWER_CANVASES; returns its error (None:
    completed), the conditioning, the loads and fix lines of its log and, with ``counters``, the simulated device's
    host-to-device copies by source shape during the prompt."""
    url, object_info, base = server
    log = base / "comfyui.log"
    start = len(log.read_text())
    if counters:
        http(url + "/simulated_device", {"reset_counters": True})
    graph = vision_tower_graph(without_missing_pack_nodes(workflow, object_info), object_info, text,
                               VISION_TOWER_CANVASES[canvas][0], tag)
    entry = finished_prompt(url, graph, base)
    text_log, saved = log.read_text()[start:], base / "output" / f"{tag}.safetensors"
    device = json.loads(http(url + "/simulated_device")[1]) if counters else None
    return {"error": error_of(entry), "conditioning": load_file(saved)["conditioning"] if saved.exists() else None,
            "loads": loads_of(text_log), "fix_lines": fix_lines_of(text_log),
            "by_shape": device and device["host_to_device_by_shape"], "vbar": device and device["dynamic_vram"]}


def hook_counts(lines: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in lines:
        found = re.search(r"MiniMax Hotfix: (\w+) hooked (\d+) module\(s\) of (\w+)", line)
        if found:
            key = f"{found.group(1)}@{found.group(3)}"
            counts[key] = counts.get(key, 0) + int(found.group(2))
    return counts


def fix_state(base: Path, fix: str) -> str | None:
    """What the server's start-up log says of ``fix`` ("needed", "fixed upstream", ...), None when it says nothing."""
    found = re.search(rf"MiniMax Hotfix: {fix}: ([\w ]+)", (base / "comfyui.log").read_text())
    return found.group(1).strip() if found else None


def max_abs_diff(tensors: dict, reference: dict, compared=H3_COMPARED) -> float | None:
    """None when a compared output is missing (the run failed before its probe)."""
    if any(name not in tensors for name in compared):
        return None
    return max((tensors[name] - reference[name]).abs().max().item() for name in compared)


def record(scenario, core, budget, loaders, result, reference, compared=H3_COMPARED):
    diff = max_abs_diff(result["tensors"], reference, compared)
    row = {"scenario": scenario, "core": core, "budget": budget, "loader": result["loader"], "loaders": loaders,
           "outcome": "completed" if result["error"] is None else f"error: {result['error'][:150]}",
           "loads": "/".join(result["loads"]), "hooks": ", ".join(f"{k}={v}" for k, v in
                                                                  hook_counts(result["fix_lines"]).items()) or "-",
           "max_abs_diff": "-" if diff is None else f"{diff:.1e}",
           "h2d": "-" if result["h2d"] is None else f"{result['h2d'] / 2**20:.2f} MiB",
           "vbar": vbar_summary(result["vbar"])}
    scenario_table.ROWS.append(row)
    print(" | ".join(str(value) for value in row.values()))
    return diff


def workflows(path: Path = H3_TEXT_TO_VIDEO) -> tuple[dict, dict]:
    """(with the pack's loaders, with stock loaders) of a bundled workflow: the stock one is the swap's reverse."""
    pack = load(path)
    stock = copy.deepcopy(pack)
    assert swap_loaders.swap(stock, reverse=True)
    return pack, stock


def template_workflows(stem: str) -> tuple[dict, dict]:
    """(with the pack's loaders, as shipped) of an official template: the pack's one is the swap tool's output."""
    stock = official_template(stem)
    pack = copy.deepcopy(stock)
    assert swap_loaders.swap(pack)
    return pack, stock


def music3_stock_and_pack(server, scenario: Scenario, device, reference: dict, tag: str) -> dict:
    """Music 3 at each of ``scenario``'s budgets in the servers without and with the pack on ``device``
    (``server(core, pack, device)``): {budget: {loaders: result}}, each recorded in the table, completed and equal
    to the all-CPU ``reference``, the stock and pack outputs equal, ComfyUI's loads whole (it never splits Music 3's
    text encoder and DAV)."""
    import torch

    (core,) = scenario.cores
    pack_workflow, stock_workflow = workflows(scenario.workflow)
    runs = {}
    for budget, total_mb in budgets(scenario).items():
        results = runs[budget] = {}
        for loaders, pack in (("stock (server without the pack)", False), ("pack", True)):
            result = run(server(core, pack, device), pack_workflow if pack else stock_workflow,
                         f"{tag}_{'pack' if pack else 'stock'}_{budget}", total_mb,
                         make_prompt=scenario.make_prompt, probes=scenario.probes)
            diff = record(scenario.name, core, budget, loaders, result, reference["tensors"], scenario.compared)
            assert result["error"] is None and diff <= 1e-4, result["error"]
            assert result["loads"] and not any("partial" in load for load in result["loads"]), result["loads"]
            results[loaders] = result
        stock, pack = (result["tensors"] for result in results.values())
        assert all(torch.equal(stock[name], pack[name]) for name in scenario.compared)
    return runs
