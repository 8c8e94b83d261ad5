"""Reaching ComfyUI from a fix without depending on it: inside ComfyUI its modules are already imported;
from the doctor or the tests, ``use_comfyui_checkout`` puts a checkout named by COMFYUI_PATH on the path."""

from __future__ import annotations

import importlib
import os
import sys


def use_comfyui_checkout(path: str | None = None) -> str | None:
    """Make the ComfyUI at ``path`` (default: $COMFYUI_PATH) importable, in CPU mode when no GPU is present.

    ComfyUI's model_management picks its device at import time and raises on a machine without a driver
    unless ``args.cpu`` is set first, so this must run before any ``comfy.model_management`` import.
    """
    path = path or os.environ.get("COMFYUI_PATH")
    if not path:
        return None
    path = os.path.abspath(path)
    if path not in sys.path:
        sys.path.insert(0, path)
    import torch
    from comfy.cli_args import args

    if not torch.cuda.is_available():
        args.cpu = True
    return path


def comfy_module(name: str):
    """The ComfyUI module ``name`` (e.g. "comfy.ldm.minimax.vae"), or None where ComfyUI or the module is absent."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
