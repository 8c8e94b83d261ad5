"""Which graph units can be captured into a CUDA graph, decided per unit from its weights' type and residency.

Stream capture forbids copying from pageable (unpinned) host memory to the GPU: PyTorch raises "Cannot copy between
CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned." and, with cudaMallocAsync, the
half-captured allocations then abort the process. A unit's forward makes such copies when

* a weight is GGUF-quantized in a type whose ComfyUI-GGUF dequantizer builds its bit-shift or lookup tables from
  Python lists (``torch.tensor([0, 4], device=...)``: a pageable host copy on every call), or falls back to numpy;
* a weight that is not streamed by the dynamic-VRAM allocator (no ``_v`` slot) lives in unpinned host memory while
  the unit computes on the GPU, so it is copied over on every call.

Everything else (plain, fp8/int8 ``QuantizedTensor``, GGUF F32/F16/BF16/Q8_0, vbar-streamed weights, whose capture
the core already limits to fully resident blocks) is capturable. diagnostics/emulated_capture.py applies the same rule
on a CPU build, where ``torch.cuda.graph`` does not exist, so the decision can be checked without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

# GGML tensor types (the GGUF file format's ids) whose ComfyUI-GGUF dequantization is a pure on-device computation.
# Every other quantized type (Q4_0/Q4_1/Q5_x, the K-quants, IQ4) shifts nibbles by tables created from Python lists
# on the weight's device, and unknown types are dequantized on the host by numpy.
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K",
                   11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 30: "BF16"}
CAPTURE_SAFE_GGML_TYPES = frozenset({0, 1, 8, 30})


@dataclass(frozen=True)
class UnitDecision:
    capture: bool
    reason: str


def ggml_type(tensor) -> int | None:
    """The GGML type id of a GGUF weight (ComfyUI-GGUF ``GGMLTensor`` or a comfy-kitchen ``GGMLLayout`` tensor)."""
    if getattr(tensor, "_layout_cls", None) == "GGMLLayout":
        return int(tensor.params.tensor_type)
    tensor_type = getattr(tensor, "tensor_type", None)
    return None if tensor_type is None else int(tensor_type)


def ggml_type_name(type_id: int) -> str:
    return GGML_TYPE_NAMES.get(type_id, f"GGML type {type_id}")


def _storage(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_qdata", tensor)


def is_pageable_host_tensor(tensor: torch.Tensor) -> bool:
    storage = _storage(tensor)
    return storage.device.type == "cpu" and not storage.is_pinned()


def _unit_tensors(roots: Iterable[torch.nn.Module]):
    for root in roots:
        for name, module in root.named_modules():
            streamed = hasattr(module, "_v")
            for kind in (module._parameters, module._buffers):
                for tensor_name, tensor in kind.items():
                    if tensor is not None:
                        yield f"{name}.{tensor_name}".lstrip("."), tensor, streamed


def decide_unit(roots: Iterable[torch.nn.Module], device) -> UnitDecision:
    """Whether a graph unit (its root modules) may be captured when it computes on ``device``."""
    device = torch.device(device)
    for name, tensor, streamed in _unit_tensors(roots):
        type_id = ggml_type(tensor)
        if type_id is not None and type_id not in CAPTURE_SAFE_GGML_TYPES:
            return UnitDecision(False, f"{name} is GGUF {ggml_type_name(type_id)}: its dequantization copies "
                                       "from host memory on every call")
        if device.type != "cpu" and not streamed and is_pageable_host_tensor(tensor):
            return UnitDecision(False, f"{name} stays in unpinned host memory and is copied to {device} on every call")
    return UnitDecision(True, "all weights are on the device, pinned, or streamed by the dynamic-VRAM allocator")
