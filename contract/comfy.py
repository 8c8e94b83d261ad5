"""Reaching ComfyUI without depending on it: inside ComfyUI its modules are already imported; from the doctor or the
tests, ``diagnostics/comfyui_checkout.py`` puts a checkout named by COMFYUI_PATH on the path first. The fixes and
these helpers import ComfyUI's modules plainly (inside the functions that need them, ``except ImportError`` where
the doctor or the tests may run without ComfyUI), so that breakage tools reading imports (comfy-import-guard) see
what each fix reaches; ``comfy_module`` serves the diagnostics, which ask for modules by name."""

from __future__ import annotations

import importlib
import inspect


def comfy_module(name: str):
    """The ComfyUI module ``name`` (e.g. "comfy.ldm.minimax.vae"), or None where ComfyUI or the module is absent."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def is_music3_text_encoder(model) -> bool:
    """Whether ``model`` is ComfyUI's MiniMax Music 3 text encoder (its AR model); False where ComfyUI lacks it."""
    try:
        from comfy.ldm.minimax_music.ar import MiniMaxMusic3AR
    except ImportError:
        return False
    return isinstance(model, MiniMaxMusic3AR)


def qwen3vl_tower_class():
    """ComfyUI's Qwen3.5/Qwen3-VL vision tower class (``Qwen35VisionModel``, or on a core that renamed it the one
    class of ``comfy.text_encoders.qwen35`` that builds both its tables), or None where this core lacks it."""
    return _qwen35_class("Qwen35VisionModel", lambda cls: {"rot_pos_emb", "fast_pos_embed_interpolate"} <= set(vars(cls)))


def qwen3vl_rotary_class():
    """The vision tower's rotary embedding class (``Qwen35VisionRotaryEmbedding``, or on a core that renamed it the
    one class of ``comfy.text_encoders.qwen35`` whose forward builds a table from ``inv_freq``), or None."""
    return _qwen35_class("Qwen35VisionRotaryEmbedding", lambda cls: "forward" in vars(cls) and "inv_freq" in getattr(
        vars(cls)["forward"], "__code__", None).co_names)


def _qwen35_class(name: str, recognised):
    try:
        import comfy.text_encoders.qwen35 as qwen35
    except ImportError:
        return None
    if hasattr(qwen35, name):
        return getattr(qwen35, name)
    found = [value for value in vars(qwen35).values() if inspect.isclass(value) and value.__module__ == qwen35.__name__
             and recognised(value)]
    return found[0] if len(found) == 1 else None

