"""GGUF files as ComfyUI-GGUF's Dynamic VRAM loaders hand them to ComfyUI: each quantized tensor a comfy-kitchen
``QuantizedTensor`` of layout "GGMLLayout" (ComfyUI-GGUF's ``quant_ops.py``), dequantized on every call as ComfyUI-GGUF
dequantizes (the pack's ``dequantize_q4_0``: shift tables from a Python list, the host copy CUDA-graph capture
refuses); F32, F16, BF16 and integer tensors plain. Q4_0 is the one quantized type written here. Used by the tests in
their own process and, through the GGUF stand-in, inside ComfyUI servers; imports no ComfyUI."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .pack_modules import pack_module

Q4_0_BLOCK_BYTES = 18
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

            if params.tensor_type != gguf.GGMLQuantizationType.Q4_0:
                raise NotImplementedError(f"GGML type {params.tensor_type}: the tests write Q4_0 only")
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
        data = gguf.quants.quantize(tensor.float().numpy(), qtype) if tensor.is_floating_point() else tensor.numpy()
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
