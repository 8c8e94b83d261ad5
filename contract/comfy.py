"""Reaching ComfyUI from a fix without depending on it: inside ComfyUI its modules are already imported; from the doctor
or the tests, ``diagnostics/comfyui_checkout.py`` puts a checkout named by COMFYUI_PATH on the path first."""

from __future__ import annotations

import importlib


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

