"""A ComfyUI checkout for the doctor, the placement audit, the benchmarks and the tests (never for ComfyUI's own
start-up, where ComfyUI is already imported): COMFYUI_PATH on the path, in CPU mode on a machine without a GPU."""

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
