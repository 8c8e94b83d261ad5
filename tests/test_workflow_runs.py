"""The bundled workflows executed by a real ComfyUI server, as a user runs them: synthetic model files
(tests/hotfix_testing/synthetic_models.py) in its models folder, the pack in its custom_nodes, each graph queued through /prompt and
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
* MiniMax H3 (the three h3 workflows): every node runs, once with the pack's loaders and once with the stock ones;
  the outputs must be identical. ComfyUI hard-codes the text encoder as a Qwen3-VL-32B truncated to 50 layers; the
  file written for it keeps its 50 layers, its vocabulary and ComfyUI's real tokenizer at a narrow width
  (synthetic_models), so the real encoder, vision tower included, runs. The conditioning node itself runs (with the
  reference or first-frame image encoded by the video VAE), then the sampler (RandomNoise, KSamplerSelect,
  BasicScheduler, BasicGuider, SamplerCustomAdvanced) on the DiT the pack's loader built from a tiny file (ComfyUI
  reads its configuration from the shapes), VAEDecode and VAEDecodeAudio through the pack's VAE loader (both VAEs at
  tiny sizes: ComfyUI hard-codes them at 2.60 B and 151 M parameters; see synthetic_models), CreateVideo and
  SaveVideo. The canvas is lowered to H3_CANVAS and the steps to H3_STEPS, the widget values a user would lower.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hotfix_testing import synthetic_models
from hotfix_testing.comfyui_server import comfyui_with_pack, run_prompt
from hotfix_testing.workflow_api import FRONTEND_ONLY, load
from hotfix_testing.workflow_prompts import (
    H3_CANVAS,
    MUSIC3,
    MUSIC3_NOT_RUN,
    PACK_ROOT,
    executed_nodes,
    fix_log_lines,
    h3_prompt,
    music3_prompt,
)
from minimax_hotfix import swap_loaders

pytestmark = pytest.mark.e2e  # real ComfyUI servers (tests/hotfix_testing/tiers.py)

H3_WORKFLOWS = sorted((PACK_ROOT / "workflows").glob("MiniMax H3 *.json"))



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


def run_with_pack_and_stock_loaders(server, path: Path, make_prompt, not_run: dict) -> dict:
    """Queues the workflow at ``path`` with the pack's loaders, then with the stock ones (tools/swap_loaders.py
    --reverse), each as ``make_prompt(workflow, object_info, tag)`` builds it; prints and checks what ran (every node
    but ``not_run``), the saved file, the probes' tensors and the fix
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
               if not key.startswith("probe")]
        (saved,) = saved_files(entry, base)
        tensors = {f"{key.removeprefix('probe_')}.{name}": tensor for key, node in prompt.items()
                   if node["class_type"] == "TestProbeSaveTensors"
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


@pytest.mark.parametrize("path", H3_WORKFLOWS, ids=lambda p: p.stem)
def test_h3_runs_identically_with_pack_and_stock_loaders(path, server):
    runs = run_with_pack_and_stock_loaders(server, path, h3_prompt, not_run={})
    for tensors, _ in runs.values():
        assert tensors["sampled.images"].shape == (H3_CANVAS["length"], H3_CANVAS["height"], H3_CANVAS["width"], 3)
