"""The Status node in a real ComfyUI server, after one prompt that decodes the same latent through a stock *Load VAE*
and through *Load VAE (MiniMax Hotfix)*: a fix this core needs reads "needed" either way, and is attached to the
pack's VAE only.

The server runs the simulated 0.36/0.37 core (tests/hotfix_testing/simulated_cores.py), whose H3 video VAE has the
``qk_norm_scale`` bug, so ``vae_qk_norm_scale`` is needed there; the VAE is the synthetic tiny one
(tests/hotfix_testing/synthetic_models.py). About 90 s on 2 cores: the core's copy, one server start, two tiny decodes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hotfix_testing import simulated_cores, synthetic_models
from hotfix_testing.comfyui_server import comfyui_with_pack, run_prompt

pytestmark = pytest.mark.e2e  # real ComfyUI servers (tests/hotfix_testing/tiers.py)

CORE = "0.36/0.37 VAE"
LATENT = {"width": 64, "height": 64, "length": 5, "batch_size": 1}


def decode_with(loader: str) -> dict:
    vae, decode = f"{loader}_vae", f"{loader}_decode"
    return {vae: {"class_type": loader, "inputs": {"vae_name": synthetic_models.H3_VIDEO_VAE_FILE}},
            decode: {"class_type": "VAEDecode", "inputs": {"samples": ["latent", 0], "vae": [vae, 0]}},
            f"{loader}_preview": {"class_type": "PreviewImage", "inputs": {"images": [decode, 0]}}}


def status_rows(report: str) -> dict[str, str]:
    """The state table's lines by fix id (the retirement table below it is left out)."""
    return {line.split()[0]: line for line in report.split("\n\n")[0].splitlines()[2:] if line[:1].strip()}


def test_status_node_after_a_stock_and_a_pack_vae_loader_in_one_server(comfyui, tmp_path):
    if not simulated_cores.available():
        pytest.skip("needs the ComfyUI tree the simulated cores are built from")
    core = simulated_cores.build_core(CORE, tmp_path / "ComfyUI")
    base = tmp_path / "base"
    synthetic_models.write_models(base / "models")
    with comfyui_with_pack(core, base, Path(__file__).with_name("comfyui_probe")) as (url, _):
        # ComfyUI's cache keeps both loaders' VAEs alive after the first prompt, as in a user's session
        prompt = {"latent": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": LATENT},
                  **decode_with("VAELoader"), **decode_with("MiniMaxHotfixVAELoader")}
        run_prompt(url, prompt, base)
        entry = run_prompt(url, {"status": {"class_type": "MiniMaxHotfixStatus", "inputs": {}}}, base)
    (report,) = entry["outputs"]["status"]["text"]
    print(f"\nMiniMax Hotfix Status on {CORE!r} after a stock and a pack VAE decode:\n{report}")
    rows = status_rows(report)
    assert "needed" in rows["vae_qk_norm_scale"]
    # one VAE, the pack's: the stock loader's VAE in the same server is not counted
    assert "attached to 1 loaded model(s)" in rows["vae_qk_norm_scale"], report
    assert "installed process-wide" in rows["ck_rope_device"], report
    assert "attached to no loaded model" in rows["music3_graph_capture"], report
