"""Shared by the Music 3 CUDA-graph tests: real GGUF weights in the two shapes ComfyUI-GGUF hands to ComfyUI (read
back from a file the ``gguf`` package wrote), the checks every Music 3 fix object passes without ComfyUI, and a tiny
text encoder's configuration."""

from dataclasses import dataclass

import numpy as np
import torch

from minimax_hotfix.contract import State
from minimax_hotfix.diagnostics import self_test
from minimax_hotfix.diagnostics.tiny_decoder import dequantize_q4_0

# projection_config of a tiny MiniMaxMusic3TEModel: 2 Llama layers
TINY_MUSIC3_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, audio_vocab_size=16, audio_num_codebooks=3, decoder_num_heads=2,
                          decoder_intermediate_size=32, decoder_num_layers=1)


def write_and_read_gguf(path, weights: dict, qtype) -> dict:
    """Quantize with the gguf package, write a .gguf file, read it back: {name: (raw bytes, torch shape, type)}."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, weight in weights.items():
        writer.add_tensor(name, gguf.quants.quantize(weight.numpy(), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: (torch.from_numpy(np.array(t.data)), tuple(int(d) for d in reversed(t.shape)), t.tensor_type)
            for t in gguf.GGUFReader(str(path)).tensors}


class GGMLTensor(torch.Tensor):
    """ComfyUI-GGUF's legacy weight: raw GGUF bytes with ``tensor_type`` and ``tensor_shape`` (GGMLOps loaders)."""

    def __new__(cls, data, tensor_type, tensor_shape):
        tensor = torch.Tensor._make_subclass(cls, data)
        tensor.tensor_type, tensor.tensor_shape = tensor_type, tensor_shape
        return tensor

    def detach(self, *args, **kwargs):
        return self  # as ComfyUI-GGUF's: nn.Parameter(weight) then keeps the tensor and its GGUF type


def ggml_layout_tensor(raw, shape, tensor_type, orig_dtype=torch.bfloat16):
    """ComfyUI-GGUF's dynamic-VRAM weight: a comfy-kitchen QuantizedTensor with a "GGMLLayout" layout."""
    from comfy_kitchen.tensor import QuantizedTensor

    params = GGMLLayoutParams(scale=torch.ones(()), orig_dtype=orig_dtype, orig_shape=tuple(shape),
                              tensor_type=int(tensor_type))
    return QuantizedTensor(raw, "GGMLLayout", params)


try:
    from comfy_kitchen.tensor import BaseLayoutParams, QuantizedLayout, get_layout_class, register_layout_class

    @dataclass(frozen=True)
    class GGMLLayoutParams(BaseLayoutParams):
        tensor_type: int

    class GGMLLayout(QuantizedLayout):
        """Q4_0 only, dequantized as ComfyUI-GGUF does (shift tables from Python lists)."""

        Params = GGMLLayoutParams

        @classmethod
        def quantize(cls, tensor, **kwargs):
            raise NotImplementedError

        @classmethod
        def dequantize(cls, qdata, params):
            return dequantize_q4_0(qdata.reshape(-1, 18), params.orig_shape, params.orig_dtype)

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


def check_not_applicable_without_comfyui(fix) -> None:
    """Without ComfyUI the fix says so; where ComfyUI is importable, test_music3_graphs_comfyui.py covers it."""
    import pytest

    if fix.detect().state is not State.NOT_APPLICABLE:
        pytest.skip("ComfyUI is importable here; see test_music3_graphs_comfyui.py")
    assert "not importable" in fix.detect().reason


def check_self_test_red_then_green(fix) -> None:
    checks = list(self_test(fix))
    assert checks and all(check.passed for check in checks), [c for c in checks if not c.passed]
    assert checks[0].name.startswith("red:")
