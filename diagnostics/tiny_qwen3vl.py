"""The tiny ComfyUI Qwen3-VL vision tower of the Qwen3-VL fixes' detection, bound to the running ComfyUI, for their
self-tests and tests (``kernels.qwen3vl_pos_embed`` builds it from the class it is handed)."""

from __future__ import annotations

import torch

from ..kernels.qwen3vl_pos_embed import TINY_QWEN3VL_GRID, TINY_QWEN3VL_TOWER
from ..kernels.qwen3vl_pos_embed import tiny_qwen3vl_tower as tiny_tower


def tiny_qwen3vl_tower(dtype=None, ops=None) -> torch.nn.Module:
    """A random tiny ComfyUI Qwen3-VL vision tower on the CPU, with ``ops`` or else the stock ``manual_cast``; the
    same weights whatever the ops."""
    import comfy.ops
    from comfy.text_encoders.qwen3vl import Qwen3VLVisionModel

    return tiny_tower(Qwen3VLVisionModel, ops or comfy.ops.manual_cast, dtype or torch.float32)


__all__ = ["TINY_QWEN3VL_GRID", "TINY_QWEN3VL_TOWER", "tiny_qwen3vl_tower"]
