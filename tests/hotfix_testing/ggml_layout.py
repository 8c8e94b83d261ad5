"""GGUF files as ComfyUI-GGUF's Dynamic VRAM loaders hand them to ComfyUI: each quantized tensor a comfy-kitchen
``QuantizedTensor`` of layout "GGMLLayout" (ComfyUI-GGUF's ``quant_ops.py``), dequantized on every call as ComfyUI-GGUF
dequantizes (the pack's ``dequantize_q4_0``: shift tables from a Python list, the host copy CUDA-graph capture
refuses; Q8_0 as ComfyUI-GGUF's ``dequantize_blocks_Q8_0``: scale times int8; Q4_K as its ``dequantize_blocks_Q4_K``);
F32, F16, BF16 and integer tensors plain. Q4_0, Q8_0 and Q4_K are the quantized types written here (Q4_K by
``quantize_q4_k``: the gguf package dequantizes Q4_K but cannot quantize it). Used by the tests in their own process
and, through the GGUF stand-in, inside ComfyUI servers; imports no ComfyUI."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .pack_modules import pack_module

Q4_0_BLOCK_BYTES = 18
# Q4_K: super-blocks of 256 values, 8 sub-blocks of 32 with 6-bit scales and mins, packed into 12 bytes
Q4_K_BLOCK, Q4_K_BLOCK_BYTES, Q4_K_SCALE_BYTES = 256, 144, 12
Q8_0_BLOCK = 32  # values per block, after the block's float16 scale
# the plain GGUF types, as the torch dtypes they hold
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8}

try:
    from comfy_kitchen.tensor import (
        BaseLayoutParams,
        QuantizedLayout,
        QuantizedTensor,
        get_layout_class,
        register_layout_class,
    )

    @dataclass(frozen=True)
    class GGMLLayoutParams(BaseLayoutParams):
        tensor_type: int

    class GGMLLayout(QuantizedLayout):
        Params = GGMLLayoutParams

        @classmethod
        def quantize(cls, tensor, **kwargs):
            raise NotImplementedError

        @classmethod
        def dequantize(cls, qdata, params):
            import gguf

            qtype = gguf.GGMLQuantizationType(params.tensor_type)
            if qtype == gguf.GGMLQuantizationType.Q8_0:
                return dequantize_q8_0(qdata, params.orig_shape, params.orig_dtype)
            if qtype == gguf.GGMLQuantizationType.Q4_K:
                return dequantize_q4_k(qdata, params.orig_shape, params.orig_dtype)
            if qtype != gguf.GGMLQuantizationType.Q4_0:
                raise NotImplementedError(f"GGML type {qtype.name}: the tests write Q4_0, Q8_0 and Q4_K only")
            dequantize_q4_0 = pack_module("diagnostics.tiny_decoder").dequantize_q4_0
            return dequantize_q4_0(qdata.reshape(-1, Q4_0_BLOCK_BYTES), params.orig_shape, params.orig_dtype)

        @classmethod
        def get_plain_tensors(cls, qtensor):
            return (qtensor._qdata,)

        @classmethod
        def state_dict_tensors(cls, qdata, params):
            return {"weight": qdata}

    try:
        get_layout_class("GGMLLayout")
    except (KeyError, ValueError):
        register_layout_class("GGMLLayout", GGMLLayout)
except ImportError:  # comfy-kitchen is in the test requirements; without it only its tests are skipped
    GGMLLayoutParams = None


def _q4_k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of each Q4_K super-block (ComfyUI-GGUF's ``get_scale_min``)."""
    low, mins, high = packed.reshape(-1, 3, 4).split(1, dim=1)
    scales = torch.cat([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([mins & 0x3F, (high >> 4) | ((mins >> 2) & 0x30)], dim=-1)
    return scales.reshape(-1, 8), mins.reshape(-1, 8)


def dequantize_q4_k(raw: torch.Tensor, shape, dtype=torch.float32) -> torch.Tensor:
    """Q4_K back to floats, as ComfyUI-GGUF's ``dequantize_blocks_Q4_K``: sub-block j of a super-block is
    ``d * scale_j * q - dmin * min_j``, its 4-bit ``q`` the low nibbles of 32 bytes (even j) or their high ones."""
    blocks = raw.reshape(-1).view(torch.uint8).reshape(-1, Q4_K_BLOCK_BYTES)
    d, dmin, packed, qs = blocks.split((2, 2, Q4_K_SCALE_BYTES, Q4_K_BLOCK // 2), dim=1)
    scales, mins = _q4_k_scales_mins(packed)
    d = d.contiguous().view(torch.float16).float() * scales.float()
    dm = dmin.contiguous().view(torch.float16).float() * mins.float()
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=raw.device).reshape(1, 1, 2, 1)
    q = ((qs.reshape(-1, 4, 1, 32) >> shifts) & 0x0F).reshape(-1, 8, 32).float()
    return (d.unsqueeze(-1) * q - dm.unsqueeze(-1)).reshape(shape).to(dtype)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """``values`` (rows a multiple of 256 wide) as Q4_K blocks, uint8 rows: a plain min-max fit of each 32-value
    sub-block (llama.cpp searches its scales; the format is the same), which ``gguf.quants.dequantize`` reads."""
    blocks = values.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(blocks.min(axis=-1), 0.0)
    step = (blocks.max(axis=-1) - low) / 15.0
    d16 = (step.max(axis=-1, keepdims=True) / 63.0).astype(np.float16)
    dmin16 = (-low.min(axis=-1, keepdims=True) / 63.0).astype(np.float16)

    def steps(value, unit):  # value / unit, 0 where the unit is 0 (an all-zero or all-positive super-block)
        unit = np.broadcast_to(unit.astype(np.float32), value.shape)
        return np.rint(np.divide(value, unit, out=np.zeros_like(value), where=unit > 0))

    scales = np.clip(steps(step, d16), 1, 63).astype(np.uint8)
    mins = np.clip(steps(-low, dmin16), 0, 63).astype(np.uint8)
    sub_scale = (d16.astype(np.float32) * scales)[..., None]
    sub_min = (dmin16.astype(np.float32) * mins)[..., None]
    q = np.clip(steps(blocks + sub_min, sub_scale), 0, 15).astype(np.uint8)
    packed = np.empty((len(blocks), 3, 4), dtype=np.uint8)
    packed[:, 0] = (scales[:, :4] & 0x3F) | ((scales[:, 4:] >> 4) << 6)
    packed[:, 1] = (mins[:, :4] & 0x3F) | ((mins[:, 4:] >> 4) << 6)
    packed[:, 2] = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    qs = (q.reshape(-1, 4, 2, 32)[:, :, 0] | (q.reshape(-1, 4, 2, 32)[:, :, 1] << 4)).reshape(-1, Q4_K_BLOCK // 2)
    out = np.concatenate([d16.view(np.uint8), dmin16.view(np.uint8), packed.reshape(-1, Q4_K_SCALE_BYTES), qs], axis=1)
    return out.reshape(values.shape[0], -1)


def ggml_layout_tensor(raw: torch.Tensor, shape, tensor_type, orig_dtype=torch.bfloat16):
    """ComfyUI-GGUF's dynamic-VRAM weight: raw GGUF blocks as a "GGMLLayout" ``QuantizedTensor`` of ``shape``."""
    params = GGMLLayoutParams(scale=torch.ones(()), orig_dtype=orig_dtype, orig_shape=tuple(shape),
                              tensor_type=int(tensor_type))
    return QuantizedTensor(raw, "GGMLLayout", params)


def write_gguf(path, tensors: dict) -> None:
    """``tensors``: {name: (tensor, GGML type)}: floating-point tensors converted by the gguf package (quantized, or
    cast to F16/BF16), integer ones written as they are."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (tensor, qtype) in tensors.items():
        if not tensor.is_floating_point():
            data = tensor.numpy()
        elif qtype == gguf.GGMLQuantizationType.Q4_K:
            data = quantize_q4_k(tensor.float().numpy().reshape(-1, tensor.shape[-1]))
        else:
            data = gguf.quants.quantize(tensor.float().numpy(), qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_gguf(path) -> dict:
    """{name: (raw data, torch shape, GGML type)} of a .gguf file, copied out of its memory map."""
    import gguf

    return {t.name: (torch.from_numpy(np.array(t.data)), tuple(int(d) for d in reversed(t.shape)), t.tensor_type)
            for t in gguf.GGUFReader(str(path)).tensors}


def gguf_state_dict(path, orig_dtype=torch.bfloat16) -> dict:
    """A .gguf file as ComfyUI-GGUF's Dynamic VRAM loaders give it to ComfyUI: quantized tensors as GGMLLayout
    ``QuantizedTensor`` weights (computing in ``orig_dtype``), plain ones as tensors of their own dtype."""
    state = {}
    for name, (raw, shape, qtype) in read_gguf(path).items():
        plain = PLAIN_TYPES.get(qtype.name)
        if plain is None:
            state[name] = ggml_layout_tensor(raw, shape, qtype, orig_dtype)
        else:
            state[name] = raw.contiguous().view(torch.uint8).view(plain).reshape(shape)
    return state


def dequantize_q8_0(qdata: torch.Tensor, shape, dtype) -> torch.Tensor:
    """Q8_0 back to floats (ComfyUI-GGUF's ``dequantize_blocks_Q8_0``): each block a float16 scale, then
    ``Q8_0_BLOCK`` int8 values."""
    blocks = qdata.reshape(-1).view(torch.uint8).reshape(-1, 2 + Q8_0_BLOCK)
    scale, values = blocks.split((2, Q8_0_BLOCK), dim=1)
    return (scale.contiguous().view(torch.float16).float() * values.contiguous().view(torch.int8).float()).reshape(
        shape).to(dtype)
