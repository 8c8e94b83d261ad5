"""The bundled workflows executed by a real ComfyUI server, as a user runs them: synthetic model files
(tests/synthetic_models.py) in its models folder, the pack in its custom_nodes, each graph queued through /prompt and
awaited on /history.

What ComfyUI 0.33.0 lets a 2-core CPU run, and what it does not:

* MiniMax Music 3: the text encoder (tiny configuration, see synthetic_models), MiniMaxMusic3TextEncode's AR loop,
  ConditioningZeroOut, the empty latent, the DAV at full size (VAEDecodeAudio) and SaveAudioMP3 run, once with the
  pack's loaders and once with the stock ones (tools/swap_loaders.py --reverse); the outputs must be identical. The
  diffusion model (Load Diffusion Model) and KSampler do not run: ComfyUI hard-codes the Music 3 DiT at 2.46 B
  parameters (36 layers of width 2048, nothing read from the file's shapes), about 10 GB in float32 on a CPU and
  minutes per step. Its sizes are literals in its constructors, not a configuration the probe could shrink as it
  does the text encoder's: even cut to one layer it keeps 107 M parameters, and its conditioner reshapes the text
  encoder output to 8 x 4096, which takes the text encoder at width 4096 (907 M parameters with two layers: the
  embeddings and heads). VAEDecodeAudio therefore decodes the empty latent instead of the sampler's.
* MiniMax H3 (the three h3 workflows): every node runs but the text encoder loader, once with the pack's loaders and
  once with the stock ones; the outputs must be identical. ComfyUI hard-codes the text encoder as a Qwen3-VL-32B
  truncated to 50 layers, far beyond a CPU: the graph queued is the bundled workflow with that loader replaced by the
  probe's stand-in (``TestProbeMiniMaxH3TextEncoder``: hidden states of the DiT's text width and per-token modality
  tags, what the H3 conditioning nodes read from the real encoder). The conditioning node itself runs (with the
  reference or first-frame image encoded by the video VAE), then the sampler (RandomNoise, KSamplerSelect,
  BasicScheduler, BasicGuider, SamplerCustomAdvanced) on the DiT the pack's loader built from a tiny file (ComfyUI
  reads its configuration from the shapes), VAEDecode and VAEDecodeAudio through the pack's VAE loader (both VAEs at
  tiny sizes: ComfyUI hard-codes them at 2.60 B and 151 M parameters; see synthetic_models), CreateVideo and
  SaveVideo. The canvas is lowered to H3_CANVAS and the steps to H3_STEPS, the widget values a user would lower.
"""

from __future__ import annotations

import copy
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

PACK_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PACK_ROOT / "tools"))
import swap_loaders  # noqa: E402
import synthetic_models  # noqa: E402
from comfyui_server import comfyui_with_pack, run_prompt  # noqa: E402
from workflow_api import FRONTEND_ONLY, load, ui_to_api  # noqa: E402

MUSIC3 = PACK_ROOT / "workflows" / "minimax_music3.json"
MUSIC3_SECONDS = 0.2  # 5 AR frames: the widget values a user would lower for a short clip
MUSIC3_NOT_RUN = {"UNETLoader": "the 2.46 B parameter Music 3 DiT is hard-coded in ComfyUI",
                  "KSampler": "needs that DiT"}
H3_WORKFLOWS = sorted((PACK_ROOT / "workflows").glob("minimax_h3_*.json"))
H3_CONDITIONING = {"MiniMaxH3ImageToVideo", "MiniMaxH3ReferenceToVideo"}
H3_CANVAS = {"width": 64, "height": 64, "length": 5}  # 5 frames, the smallest of the 17k+5 grid: latent 24x2x4x4
H3_STEPS = 2
H3_NOT_RUN: dict = {}
FIX_LOG = re.compile(r"MiniMax Hotfix: (\w+) (attached to \w+ .*|hooked \d+ module\(s\) of \w+.*)$")


@pytest.fixture(scope="module")
def server(comfyui, tmp_path_factory):
    """A ComfyUI with the pack, the test probe node and the synthetic models; (url, object_info, base)."""
    started = time.monotonic()
    base = tmp_path_factory.mktemp("comfy_run")
    synthetic_models.write_models(base / "models")
    # --cache-none: every node of every run executes, none is taken from an earlier run's cache
    with comfyui_with_pack(Path(comfyui), base, Path(__file__).with_name("comfyui_probe"),
                           options=("--cache-none",)) as (url, object_info):
        assert "TestProbeSaveTensors" in object_info, (
            "the probe node did not load:\n" + (base / "comfyui.log").read_text()[-4000:])
        print(f"\nserver ready with synthetic models in {time.monotonic() - started:.1f} s")
        yield url, object_info, base


def executed_nodes(entry: dict, prompt: dict) -> list[str]:
    cached = {node for kind, data in entry["status"]["messages"] if kind == "execution_cached" for node in data["nodes"]}
    return [node_id for node_id in prompt if node_id not in cached]


def stock_type(class_type: str) -> str:
    return swap_loaders.PACK_TO_STOCK.get(class_type, class_type)


def node_id(prompt: dict, class_type: str) -> str:
    (found,) = [key for key, node in prompt.items() if node["class_type"] == class_type]
    return found


def music3_prompt(workflow: dict, object_info: dict, tag: str) -> dict:
    """The workflow as the frontend queues it, shortened to MUSIC3_SECONDS, minus the nodes that cannot run here;
    probe nodes save the conditioning, the zeroed conditioning and the decoded audio for comparison."""
    prompt = ui_to_api(workflow, object_info)
    encode, latent = node_id(prompt, "MiniMaxMusic3TextEncode"), node_id(prompt, "EmptyMiniMaxMusic3LatentAudio")
    prompt[encode]["inputs"]["max_duration"] = MUSIC3_SECONDS
    prompt[node_id(prompt, "VAEDecodeAudio")]["inputs"]["samples"] = [latent, 0]
    prompt[node_id(prompt, "SaveAudioMP3")]["inputs"]["filename_prefix"] = f"audio/{tag}"
    for key in [key for key, node in prompt.items() if stock_type(node["class_type"]) in MUSIC3_NOT_RUN]:
        del prompt[key]
    prompt["probe_encoded"] = {"class_type": "TestProbeSaveTensors", "inputs": {
        "filename": f"{tag}_encoded", "conditioning": [encode, 0], "audio": [node_id(prompt, "VAEDecodeAudio"), 0]}}
    prompt["probe_zeroed"] = {"class_type": "TestProbeSaveTensors", "inputs": {
        "filename": f"{tag}_zeroed", "conditioning": [node_id(prompt, "ConditioningZeroOut"), 0]}}
    return prompt


def fix_log_lines(base: Path, start: int) -> list[str]:
    """The pack's attach and hook lines ComfyUI logged from character ``start`` of its log on."""
    text = (base / "comfyui.log").read_text()[start:]
    return [match.group(0) for line in text.splitlines() if (match := FIX_LOG.search(line))]


def run_with_pack_and_stock_loaders(server, path: Path, make_prompt, not_run: dict, stand_ins=()) -> dict:
    """Queues the workflow at ``path`` with the pack's loaders, then with the stock ones (tools/swap_loaders.py
    --reverse), each as ``make_prompt(workflow, object_info, tag)`` builds it; prints and checks what ran (every node
    but ``not_run``; ``stand_ins`` are the probe nodes in their place), the saved file, the probes' tensors and the fix
    log lines; asserts the two runs' tensors are identical. Returns {"pack"/"stock": (tensors, log lines)}."""
    url, object_info, base = server
    pack_workflow = load(path)
    stock_workflow = copy.deepcopy(pack_workflow)
    assert swap_loaders.swap(stock_workflow, reverse=True)
    total = sum(node["type"] not in FRONTEND_ONLY for node in pack_workflow["nodes"])
    runs = {}
    for tag, workflow in (("pack", pack_workflow), ("stock", stock_workflow)):
        log_start = len((base / "comfyui.log").read_text())
        prompt = make_prompt(workflow, object_info, f"{path.stem}_{tag}")
        started = time.monotonic()
        entry = run_prompt(url, prompt, base)
        wall = time.monotonic() - started
        ran = [prompt[key]["class_type"] for key in executed_nodes(entry, prompt)
               if not key.startswith("probe") and prompt[key]["class_type"] not in stand_ins]
        (saved,) = saved_files(entry, base)
        tensors = {f"{key.removeprefix('probe_')}.{name}": tensor for key, node in prompt.items()
                   if key.startswith("probe")
                   for name, tensor in load_file(base / "output" / f"{node['inputs']['filename']}.safetensors").items()}
        lines = fix_log_lines(base, log_start)
        print(f"\n{path.name} [{tag} loaders]: {len(ran)}/{total} nodes executed in {wall:.1f} s: {ran}")
        print("  not executed: " + "; ".join(f"{name}: {why}" for name, why in not_run.items()))
        print(f"  {saved.name}: {saved.stat().st_size} bytes; " + ", ".join(
            f"{name} {tuple(tensor.shape)}" for name, tensor in tensors.items()))
        print("  " + "\n  ".join(lines or ["(no fix attached)"]))
        assert len(ran) == total - len(not_run)
        assert saved.stat().st_size > 0
        assert all(torch.isfinite(tensor).all() for tensor in tensors.values())
        if tag == "stock":
            assert not lines, "the stock loaders must not attach anything"
        runs[tag] = tensors, lines
    for name, tensor in runs["pack"][0].items():
        diff = (tensor - runs["stock"][0][name]).abs().max().item()
        print(f"  pack vs stock {name}: max abs diff {diff}")
        assert diff == 0, name
    return runs


def saved_files(entry: dict, base: Path) -> list[Path]:
    """The files the workflow's own output nodes saved (not the probes')."""
    return [base / "output" / item["subfolder"] / item["filename"]
            for key, output in entry["outputs"].items() if not key.startswith("probe")
            for items in output.values() if isinstance(items, list)
            for item in items if isinstance(item, dict) and "filename" in item]


def test_music3_runs_identically_with_pack_and_stock_loaders(server):
    runs = run_with_pack_and_stock_loaders(server, MUSIC3, music3_prompt, MUSIC3_NOT_RUN)
    lines = runs["pack"][1]
    attached = {line.split()[2] for line in lines if "attached to MiniMaxMusic3TEModel" in line}
    hooked = {line.split()[2] for line in lines if "module(s) of MiniMaxMusic3TEModel" in line}
    # a fix whose attach finds nothing to change (int8_full_precision_mm on a model without int8 layers) logs its
    # attach line but installs no injection, so it logs no hook count
    assert "music3_graph_capture" in hooked and hooked <= attached, lines


def h3_prompt(workflow: dict, object_info: dict, tag: str) -> dict:
    """The workflow as the frontend queues it with a tiny canvas (H3_CANVAS), H3_STEPS steps; probe nodes save the
    conditioning (the text encoder's hidden states), the sampler's latent and the decoded frames and audio."""
    prompt = ui_to_api(workflow, object_info)
    (conditioning,) = [key for key, node in prompt.items() if node["class_type"] in H3_CONDITIONING]
    prompt[conditioning]["inputs"].update(H3_CANVAS)
    prompt[node_id(prompt, "BasicScheduler")]["inputs"]["steps"] = H3_STEPS
    prompt[node_id(prompt, "SaveVideo")]["inputs"]["filename_prefix"] = f"video/{tag}"
    prompt["probe_sampled"] = {"class_type": "TestProbeSaveTensors", "inputs": {
        "filename": f"{tag}_sampled", "conditioning": [conditioning, 0],
        "latent": [node_id(prompt, "SamplerCustomAdvanced"), 0],
        "images": [node_id(prompt, "VAEDecode"), 0], "audio": [node_id(prompt, "VAEDecodeAudio"), 0]}}
    return prompt


@pytest.mark.parametrize("path", H3_WORKFLOWS, ids=lambda p: p.stem)
def test_h3_runs_identically_with_pack_and_stock_loaders(path, server):
    runs = run_with_pack_and_stock_loaders(server, path, h3_prompt, H3_NOT_RUN)
    for tensors, _ in runs.values():
        assert tensors["sampled.images"].shape == (H3_CANVAS["length"], H3_CANVAS["height"], H3_CANVAS["width"], 3)
