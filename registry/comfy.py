"""Reaching ComfyUI from a fix without depending on it: inside ComfyUI its modules are already imported;
from the doctor or the tests, ``use_comfyui_checkout`` puts a checkout named by COMFYUI_PATH on the path."""

from __future__ import annotations

import importlib
import os
import sys


class ComfyUIUnavailable(RuntimeError):
    """COMFYUI_PATH names no usable ComfyUI; the message is one line saying what to do."""


def use_comfyui_checkout(path: str | None = None) -> str | None:
    """Make the ComfyUI at ``path`` (default: $COMFYUI_PATH) importable, in CPU mode when no GPU is present.

    ComfyUI's model_management picks its device at import time and raises on a machine without a driver
    unless ``args.cpu`` is set first, so this must run before any ``comfy.model_management`` import.
    Raises ``ComfyUIUnavailable`` when the path is not a ComfyUI tree or its requirements are missing from this
    Python: fixes would otherwise read "not applicable" against a ComfyUI they never saw.
    """
    path = path or os.environ.get("COMFYUI_PATH")
    if not path:
        return None
    path = os.path.abspath(path)
    if not (os.path.isfile(os.path.join(path, "comfy", "cli_args.py")) and os.path.isfile(os.path.join(path, "nodes.py"))):
        raise ComfyUIUnavailable(f"COMFYUI_PATH={path} is not a ComfyUI checkout (no comfy/cli_args.py and nodes.py "
                                 "there): set it to the folder that holds ComfyUI's main.py")
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        import torch
        from comfy.cli_args import args

        if not torch.cuda.is_available():
            args.cpu = True
        importlib.import_module("comfy.model_patcher")  # what the pack needs: fails on a missing requirement
    except ImportError as exc:
        raise ComfyUIUnavailable(f"ComfyUI at {path} cannot be imported by {sys.executable} ({exc}): run with "
                                 f"ComfyUI's own Python, or install its requirements: "
                                 f"{sys.executable} -m pip install -r {os.path.join(path, 'requirements.txt')}") from exc
    return path


def comfy_module(name: str):
    """The ComfyUI module ``name`` (e.g. "comfy.ldm.minimax.vae"), or None where ComfyUI or the module is absent."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def is_music3_text_encoder(model) -> bool:
    """Whether ``model`` is ComfyUI's MiniMax Music 3 text encoder (its AR model); False where ComfyUI lacks it."""
    ar = comfy_module("comfy.ldm.minimax_music.ar")
    return ar is not None and isinstance(model, ar.MiniMaxMusic3AR)


def qwen3vl_tower_class():
    """ComfyUI's Qwen3.5/Qwen3-VL vision tower class (``Qwen35VisionModel``), or None where this core lacks it."""
    return getattr(comfy_module("comfy.text_encoders.qwen35"), "Qwen35VisionModel", None)


TINY_QWEN3VL_TOWER = dict(spatial_merge_size=2, patch_size=4, hidden_size=32, num_heads=2, num_position_embeddings=64,
                          temporal_patch_size=2, in_channels=3, intermediate_size=48, depth=1, out_hidden_size=40)
TINY_QWEN3VL_GRID = ((1, 4, 6), (2, 2, 2), (1, 10, 14))


def tiny_qwen3vl_tower(dtype=None, ops=None):
    """A random tiny ComfyUI Qwen3-VL vision tower on CPU (the Qwen3-VL fixes' detection, self-tests), with ``ops`` or
    else the stock ``manual_cast``; the same weights whatever the ops."""
    import comfy.ops
    import torch
    from comfy.text_encoders.qwen3vl import Qwen3VLVisionModel

    dtype = dtype or torch.float32
    generator = torch.Generator().manual_seed(0)
    tower = Qwen3VLVisionModel({**TINY_QWEN3VL_TOWER, "deepstack_visual_indexes": [0]}, dtype=dtype,
                               ops=ops or comfy.ops.manual_cast)
    for parameter in tower.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator).mul_(0.1).to(dtype)
    return tower
