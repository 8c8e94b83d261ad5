"""The bundled workflows executed by a real ComfyUI server, as a user runs them: synthetic model files
(tests/synthetic_models.py) in its models folder, the pack in its custom_nodes, each graph queued through /prompt and
awaited on /history.

What ComfyUI 0.33.0 lets a 2-core CPU run, and what it does not:

* MiniMax Music 3: the text encoder (tiny configuration, see synthetic_models), MiniMaxMusic3TextEncode's AR loop,
  ConditioningZeroOut, the empty latent, the DAV at full size (VAEDecodeAudio) and SaveAudioMP3 run, once with the
  pack's loaders and once with the stock ones (tools/swap_loaders.py --reverse); the outputs must be identical. The
  diffusion model (Load Diffusion Model) and KSampler do not run: ComfyUI hard-codes the Music 3 DiT at 2.46 B
  parameters (36 layers of width 2048, nothing read from the file's shapes), about 10 GB in float32 on a CPU and
  minutes per step, and its conditioner needs the 4096-wide text encoder output. VAEDecodeAudio therefore decodes
  the empty latent instead of the sampler's.
* MiniMax H3 (the three h3 workflows): the diffusion model loads through the pack's loader from a tiny file whose
  configuration ComfyUI reads from its shapes (real MiniMaxH3Model), and BasicScheduler computes the sigmas from it.
  Nothing else runs: see H3_NOT_RUN.
"""

from __future__ import annotations

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
import swap_loaders  # noqa: E402
import synthetic_models  # noqa: E402
from comfyui_server import comfyui_with_pack, http  # noqa: E402
from workflow_api import FRONTEND_ONLY, load, ui_to_api  # noqa: E402

RUN_TIMEOUT_S = 300
MUSIC3 = PACK_ROOT / "workflows" / "minimax_music3.json"
MUSIC3_SECONDS = 0.2  # 5 AR frames: the widget values a user would lower for a short clip
MUSIC3_NOT_RUN = {"UNETLoader": "the 2.46 B parameter Music 3 DiT is hard-coded in ComfyUI",
                  "KSampler": "needs that DiT"}
H3_WORKFLOWS = sorted((PACK_ROOT / "workflows").glob("minimax_h3_*.json"))
H3_RUNS = {"MiniMaxHotfixUNETLoader", "BasicScheduler"}
H3_TEXT_ENCODER = "the Qwen3-VL-32B text encoder (50 layers) is hard-coded in ComfyUI, far beyond a CPU"
H3_NOT_RUN = {
    "MiniMaxHotfixCLIPLoader": H3_TEXT_ENCODER,
    "MiniMaxH3ImageToVideo": "needs that text encoder", "MiniMaxH3ReferenceToVideo": "needs that text encoder",
    "LoadImage": "its only consumer is the H3 conditioning node",
    "MiniMaxHotfixVAELoader": "video VAE: 2.6 B parameters hard-coded (about 10 GB in float32 on a CPU); audio VAE: "
                              "its only consumer decodes the sampler's output",
    "RandomNoise": "feeds only the sampler", "KSamplerSelect": "feeds only the sampler",
    "BasicGuider": "needs the H3 conditioning", "SamplerCustomAdvanced": "needs the H3 conditioning and latent",
    "VAEDecode": "needs the sampler's latent", "VAEDecodeAudio": "needs the sampler's latent",
    "CreateVideo": "needs the decoded frames and audio", "SaveVideo": "needs the video",
    "MiniMaxHotfixStatus": "not an input of what runs here (it ran in the Music 3 run)",
}
FIX_LOG = re.compile(r"MiniMax Hotfix: (\w+) (attached to \w+ .*|hooked \d+ module\(s\) of \w+.*)$")


@pytest.fixture(scope="module")
def server(comfyui, tmp_path_factory):
    """A ComfyUI with the pack, the test probe node and the synthetic models; (url, object_info, base)."""
    started = time.monotonic()
    base = tmp_path_factory.mktemp("comfy_run")
    synthetic_models.write_models(base / "models")
    with comfyui_with_pack(Path(comfyui), base, Path(__file__).with_name("comfyui_probe"),
                           env=synthetic_models.music3_text_encoder_env()) as (url, object_info):
        assert "TestProbeSaveTensors" in object_info, (
            "the probe node did not load:\n" + (base / "comfyui.log").read_text()[-4000:])
        print(f"\nserver ready with synthetic models in {time.monotonic() - started:.1f} s")
        yield url, object_info, base


def run_prompt(url: str, prompt: dict, base: Path) -> dict:
    """Queues ``prompt`` and waits for its /history entry; returns it. Fails on a validation or execution error."""
    status, body = http(url + "/prompt", {"prompt": prompt, "client_id": "minimax-hotfix-tests"})
    assert status == 200, body.decode()
    prompt_id = json.loads(body)["prompt_id"]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        entry = json.loads(http(f"{url}/history/{prompt_id}")[1]).get(prompt_id)
        if entry and entry["status"].get("completed") is not None:
            assert entry["status"]["status_str"] == "success", (
                json.dumps(entry["status"]["messages"])[-3000:] + (base / "comfyui.log").read_text()[-4000:])
            return entry
        time.sleep(0.5)
    pytest.fail(f"prompt {prompt_id} did not finish in {RUN_TIMEOUT_S} s:\n" + (base / "comfyui.log").read_text()[-4000:])


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
    prompt["probe_conditioning"] = {"class_type": "TestProbeSaveTensors", "inputs": {
        "filename": f"{tag}_conditioning", "conditioning": [encode, 0], "audio": [node_id(prompt, "VAEDecodeAudio"), 0]}}
    prompt["probe_zeroed"] = {"class_type": "TestProbeSaveTensors", "inputs": {
        "filename": f"{tag}_zeroed", "conditioning": [node_id(prompt, "ConditioningZeroOut"), 0]}}
    return prompt


def fix_log_lines(base: Path, start: int) -> list[str]:
    """The pack's attach and hook lines ComfyUI logged from character ``start`` of its log on."""
    text = (base / "comfyui.log").read_text()[start:]
    return [match.group(0) for line in text.splitlines() if (match := FIX_LOG.search(line))]


def test_music3_runs_identically_with_pack_and_stock_loaders(server):
    url, object_info, base = server
    pack_workflow = load(MUSIC3)
    stock_workflow = copy.deepcopy(pack_workflow)
    assert swap_loaders.swap(stock_workflow, reverse=True)
    total = sum(node["type"] not in FRONTEND_ONLY for node in pack_workflow["nodes"])
    outputs = {}
    for tag, workflow in (("pack", pack_workflow), ("stock", stock_workflow)):
        log_start = len((base / "comfyui.log").read_text())
        prompt = music3_prompt(workflow, object_info, f"music3_{tag}")
        started = time.monotonic()
        entry = run_prompt(url, prompt, base)
        wall = time.monotonic() - started
        ran = [prompt[key]["class_type"] for key in executed_nodes(entry, prompt) if not key.startswith("probe")]
        (mp3,) = entry["outputs"][node_id(prompt, "SaveAudioMP3")]["audio"]
        mp3_path = base / "output" / mp3["subfolder"] / mp3["filename"]
        tensors = {**load_file(base / "output" / f"music3_{tag}_conditioning.safetensors"),
                   "zeroed": load_file(base / "output" / f"music3_{tag}_zeroed.safetensors")["conditioning"]}
        outputs[tag] = tensors
        lines = fix_log_lines(base, log_start)
        print(f"\n{MUSIC3.name} [{tag} loaders]: {len(ran)}/{total} nodes executed in {wall:.1f} s: {ran}")
        print(f"  not executed: {MUSIC3_NOT_RUN}")
        print(f"  {mp3_path.name}: {mp3_path.stat().st_size} bytes; " + ", ".join(
            f"{name} {tuple(tensor.shape)}" for name, tensor in tensors.items()))
        print("  " + "\n  ".join(lines or ["(no fix attached)"]))
        assert len(ran) == total - len(MUSIC3_NOT_RUN)
        assert mp3_path.stat().st_size > 0
        assert all(torch.isfinite(tensor).all() for tensor in tensors.values())
        if tag == "pack":
            attached = {line.split()[2] for line in lines if "attached to MiniMaxMusic3TEModel" in line}
            hooked = {line.split()[2] for line in lines if "module(s) of MiniMaxMusic3TEModel" in line}
            assert "music3_graph_capture" in attached and attached == hooked, lines
        else:
            assert not lines, "the stock loaders must not attach anything"
    for name in outputs["pack"]:
        diff = (outputs["pack"][name] - outputs["stock"][name]).abs().max().item()
        print(f"  pack vs stock {name}: max abs diff {diff}")
        assert diff == 0, name


@pytest.mark.parametrize("path", H3_WORKFLOWS, ids=lambda p: p.stem)
def test_h3_diffusion_model_loads_through_the_pack_and_schedules(path, server):
    url, object_info, base = server
    workflow = load(path)
    full = ui_to_api(workflow, object_info)
    prompt = {key: node for key, node in full.items() if node["class_type"] in H3_RUNS}
    prompt["probe_sigmas"] = {"class_type": "TestProbeSaveTensors", "inputs": {
        "filename": f"{path.stem}_sigmas", "sigmas": [node_id(prompt, "BasicScheduler"), 0]}}
    log_start = len((base / "comfyui.log").read_text())
    started = time.monotonic()
    entry = run_prompt(url, prompt, base)
    wall = time.monotonic() - started
    ran = [prompt[key]["class_type"] for key in executed_nodes(entry, prompt) if not key.startswith("probe")]
    sigmas = load_file(base / "output" / f"{path.stem}_sigmas.safetensors")["sigmas"]
    lines = fix_log_lines(base, log_start)
    skipped = sorted({node["class_type"] for node in full.values()} - H3_RUNS)
    print(f"\n{path.name}: {len(ran)}/{len(full)} nodes executed in {wall:.1f} s: {ran}; sigmas {tuple(sigmas.shape)}")
    print("  not executed: " + "; ".join(f"{name}: {H3_NOT_RUN[name]}" for name in skipped))
    print("  " + "\n  ".join(lines or ["(no fix attached: the loaded model was cached)"]))
    assert set(skipped) <= set(H3_NOT_RUN)
    steps = full[node_id(full, "BasicScheduler")]["inputs"]["steps"]
    assert sigmas.shape == (steps + 1,) and torch.isfinite(sigmas).all()
