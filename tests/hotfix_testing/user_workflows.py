"""Workflows as users have them before the swap, built from the bundled ones: MiniMax Music 3 with ComfyUI-GGUF's
``CLIPLoaderGGUFDynamicVRAM`` wired straight to the text encoder, and Music 3 loaded from one ``CheckpointLoaderSimple``."""

from __future__ import annotations

import json
from pathlib import Path

from minimax_hotfix import swap_loaders

PACK_ROOT = Path(__file__).resolve().parents[2]


def _stock(name: str) -> dict:
    """A bundled workflow back on stock loaders, without the pack's Status node."""
    workflow = json.loads((PACK_ROOT / "workflows" / name).read_text(encoding="utf-8"))
    swap_loaders.swap(workflow, reverse=True)
    workflow["nodes"] = [node for node in workflow["nodes"] if node["type"] != "MiniMaxHotfixStatus"]
    return workflow


def _by_type(workflow: dict, node_type: str) -> dict:
    return next(node for node in workflow["nodes"] if node["type"] == node_type)


def _link(workflow: dict, link_id: int) -> list:
    return next(link for link in workflow["links"] if link[0] == link_id)


def music3_gguf() -> dict:
    """Music 3 with the GGUF text encoder feeding MiniMaxMusic3TextEncode directly, as before the pack."""
    workflow = _stock("MiniMax Music 3 with a GGUF text encoder.json")
    gguf, apply = _by_type(workflow, "CLIPLoaderGGUFDynamicVRAM"), _by_type(workflow, "MiniMaxHotfixApplyCLIP")
    (into_apply,), (out_of_apply,) = gguf["outputs"][0]["links"], apply["outputs"][0]["links"]
    _link(workflow, out_of_apply)[1:3] = [gguf["id"], 0]
    gguf["outputs"][0]["links"] = [out_of_apply]
    workflow["links"].remove(_link(workflow, into_apply))
    workflow["nodes"].remove(apply)
    return workflow


def music3_checkpoint() -> dict:
    """Music 3 with model, text encoder and VAE from one CheckpointLoaderSimple."""
    workflow = _stock("MiniMax Music 3.json")
    unet, clip, vae = (_by_type(workflow, t) for t in ("UNETLoader", "CLIPLoader", "VAELoader"))
    unet.update(type="CheckpointLoaderSimple", widgets_values=["minimax_music3_all_in_one.safetensors"])
    unet["properties"] = {"cnr_id": "comfy-core", "ver": "0.33.0", "Node name for S&R": "CheckpointLoaderSimple"}
    unet["outputs"] += [{"localized_name": kind, "name": kind, "type": kind, "links": []} for kind in ("CLIP", "VAE")]
    for slot, loader in ((1, clip), (2, vae)):
        for link_id in loader["outputs"][0]["links"]:
            _link(workflow, link_id)[1:3] = [unet["id"], slot]
            unet["outputs"][slot]["links"].append(link_id)
        workflow["nodes"].remove(loader)
    return workflow
