"""Counting host-to-device bytes on a CPU-only machine, with ``meta`` as the compute device: ComfyUI's ops cast CPU
weights to their input's device, so a model whose inputs are on meta copies every offloaded weight (and every table
built on the CPU) there. Used by benchmarks/qwen3vl_pos_embed.py and tests/test_qwen3vl_pos_embed_traffic.py; it lives
here, not in tests/, because the registry package ships benchmarks/ without tests/.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostToMeta(TorchDispatchMode):
    """Bytes copied from CPU tensors to meta tensors inside the block (under inference_mode ``aten.to`` reaches the
    mode whole, outside it ``_to_copy``: either is counted once, by its result)."""

    _MOVES = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device,
              torch.ops.aten.to.other}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._MOVES and args[0].device.type == "cpu" and out.device.type == "meta":
            self.bytes += out.numel() * out.element_size()
        elif func is torch.ops.aten.copy_.default and args[0].device.type == "meta" and args[1].device.type == "cpu":
            self.bytes += args[0].numel() * args[0].element_size()
        return out
