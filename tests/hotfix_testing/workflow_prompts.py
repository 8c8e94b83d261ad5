"""The bundled workflows and the official templates as the frontend queues them, lowered to what a 2-core CPU runs
(a tiny canvas, few steps, a short clip), with probe nodes that save the tensors to compare; and the pack's lines in
ComfyUI's log. Shared by the server tests (tests/test_workflow_runs.py, tests/test_seed_scenarios_on_device.py,
tests/test_h3_vision_tower_on_device.py, tests/test_official_templates_on_device.py)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parents[2]
from hotfix_testing.workflow_api import MODEL_FOLDERS, OFFICIAL_TEMPLATES, load, official_template, ui_to_api  # noqa: E402
from minimax_hotfix import swap_loaders

MUSIC3 = PACK_ROOT / "workflows" / "MiniMax Music 3.json"
MUSIC3_SECONDS = 0.2  # 5 AR frames: the widget values a user would lower for a short clip
MUSIC3_NOT_RUN = {"UNETLoader": "the 2.46 B parameter Music 3 DiT is hard-coded in ComfyUI",
                  "KSampler": "needs that DiT"}
H3_CONDITIONING = {"MiniMaxH3ImageToVideo", "MiniMaxH3ReferenceToVideo"}
H3_CANVAS = {"width": 64, "height": 64, "length": 5}  # 5 frames, the smallest of the 17k+5 grid: latent 24x2x4x4
H3_STEPS = 2
FIX_LOG = re.compile(r"MiniMax Hotfix: (\w+) (attached to \w+ .*|hooked \d+ module\(s\) of \w+.*)$")


def executed_nodes(entry: dict, prompt: dict) -> list[str]:
    cached = {node for kind, data in entry["status"]["messages"] if kind == "execution_cached" for node in data["nodes"]}
    return [node_id for node_id in prompt if node_id not in cached]


def stock_type(class_type: str) -> str:
    return swap_loaders.PACK_TO_STOCK.get(class_type, class_type)


def node_id(prompt: dict, class_type: str) -> str:
    (found,) = [key for key, node in prompt.items() if node["class_type"] == class_type]
    return found


def saved_output(prompt: dict, prefix: str) -> str:
    """The id of the prompt's one saving node, now saving under ``prefix``."""
    (save,) = [key for key, node in prompt.items() if "filename_prefix" in node["inputs"]]
    prompt[save]["inputs"]["filename_prefix"] = prefix
    return save


def music3_prompt(workflow: dict, object_info: dict, tag: str) -> dict:
    """The workflow as the frontend queues it, shortened to MUSIC3_SECONDS, minus the nodes that cannot run here
    (what took the sampled latent takes the empty one); probe nodes save the conditioning, the zeroed conditioning and
    the audio the workflow saves, for comparison."""
    prompt = ui_to_api(workflow, object_info)
    encode, sampler = node_id(prompt, "MiniMaxMusic3TextEncode"), node_id(prompt, "KSampler")
    prompt[encode]["inputs"]["max_duration"] = MUSIC3_SECONDS
    unsampled = prompt[sampler]["inputs"]["latent_image"]
    for key in [key for key, node in prompt.items() if stock_type(node["class_type"]) in MUSIC3_NOT_RUN]:
        del prompt[key]
    for node in prompt.values():
        node["inputs"].update({name: unsampled for name, value in node["inputs"].items() if value == [sampler, 0]})
    save = saved_output(prompt, f"audio/{tag}")
    prompt["probe_encoded"] = {"class_type": "TestProbeSaveTensors", "inputs": {
        "filename": f"{tag}_encoded", "conditioning": [encode, 0], "audio": prompt[save]["inputs"]["audio"]}}
    prompt["probe_zeroed"] = {"class_type": "TestProbeSaveTensors", "inputs": {
        "filename": f"{tag}_zeroed", "conditioning": [node_id(prompt, "ConditioningZeroOut"), 0]}}
    return prompt


def fix_log_lines(base: Path, start: int) -> list[str]:
    """The pack's attach and hook lines ComfyUI logged from character ``start`` of its log on."""
    text = (base / "comfyui.log").read_text()[start:]
    return [match.group(0) for line in text.splitlines() if (match := FIX_LOG.search(line))]


def h3_prompt(workflow: dict, object_info: dict, tag: str) -> dict:
    """The workflow as the frontend queues it with a tiny canvas (H3_CANVAS), H3_STEPS steps; probe nodes save the
    conditioning (the text encoder's hidden states), the sampler's latent and the decoded frames and audio, and the
    audio VAE's decode of a fixed latent (the comparable audio output)."""
    prompt = ui_to_api(workflow, object_info)
    (conditioning,) = [key for key, node in prompt.items() if node["class_type"] in H3_CONDITIONING]
    prompt[conditioning]["inputs"].update(H3_CANVAS)
    prompt[node_id(prompt, "BasicScheduler")]["inputs"]["steps"] = H3_STEPS
    saved_output(prompt, f"video/{tag}")
    prompt["probe_sampled"] = {"class_type": "TestProbeSaveTensors", "inputs": {
        "filename": f"{tag}_sampled", "conditioning": [conditioning, 0],
        "latent": [node_id(prompt, "SamplerCustomAdvanced"), 0],
        "images": [node_id(prompt, "VAEDecode"), 0], "audio": [node_id(prompt, "VAEDecodeAudio"), 0]}}
    audio_vae = prompt[node_id(prompt, "VAEDecodeAudio")]["inputs"]["vae"]
    prompt["probe_fixed_latent"] = {"class_type": "TestProbeFixedLatent", "inputs": {
        "latent": [node_id(prompt, "SamplerCustomAdvanced"), 0]}}
    prompt["probe_fixed_audio"] = {"class_type": "VAEDecodeAudio", "inputs": {
        "samples": ["probe_fixed_latent", 0], "vae": audio_vae}}
    prompt["probe_fixed"] = {"class_type": "TestProbeSaveTensors", "inputs": {
        "filename": f"{tag}_fixed", "audio": ["probe_fixed_audio", 0]}}
    return prompt


def h3_prompt_video_vae_on_device_1(workflow: dict, object_info: dict, tag: str) -> dict:
    """``h3_prompt`` with the video VAE put on the second device by ComfyUI's own Select VAE Device ("gpu:1",
    between its loader and VAE Decode, a deep clone of the VAE's patcher there): the DiT computes on the first
    device, the video VAE on the second."""
    prompt = h3_prompt(workflow, object_info, tag)
    decode = prompt[node_id(prompt, "VAEDecode")]["inputs"]
    prompt["select_vae_device"] = {"class_type": "SelectVAEDevice", "inputs": {"vae": decode["vae"], "device": "gpu:1"}}
    decode["vae"] = ["select_vae_device", 0]
    return prompt


@functools.cache  # read once per run: the session fixtures ask for it per models folder and per core
def official_template_inputs() -> tuple[frozenset[tuple[str, str]], frozenset[str]]:
    """What the official templates (OFFICIAL_TEMPLATES) load: (ComfyUI model folder, file name) of every model file
    and the name of every input image, read from the prompts the frontend would queue."""
    specs = load(PACK_ROOT / "tests" / "workflow_node_specs.json")["nodes"]
    nodes = [node for stem in OFFICIAL_TEMPLATES.values() for node in ui_to_api(official_template(stem), specs).values()]
    models = frozenset((MODEL_FOLDERS[name], value) for node in nodes for name, value in node["inputs"].items()
                       if name in MODEL_FOLDERS)
    return models, frozenset(node["inputs"]["image"] for node in nodes if node["class_type"] == "LoadImage")
