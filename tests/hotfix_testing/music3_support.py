"""Shared by the Music 3 CUDA-graph tests: real GGUF weights in the two shapes ComfyUI-GGUF hands to ComfyUI (read
back from a file the ``gguf`` package wrote), the checks every Music 3 fix object passes without ComfyUI, a tiny
text encoder, and Music 3's graphed AR loop emulated on the CPU."""

import contextlib

import torch

from hotfix_testing.emulated_graphs import emulated_graph_path
from hotfix_testing.ggml_layout import ggml_layout_tensor, read_gguf, write_gguf
from minimax_hotfix.contract import State
from minimax_hotfix.diagnostics import self_test
from minimax_hotfix.diagnostics.emulated_capture import emulated_capture

# projection_config of a tiny MiniMaxMusic3TEModel: 2 Llama layers
TINY_MUSIC3_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, audio_vocab_size=16, audio_num_codebooks=3, decoder_num_heads=2,
                          decoder_intermediate_size=32, decoder_num_layers=1)


def write_and_read_gguf(path, weights: dict, qtype) -> dict:
    """Quantize with the gguf package, write a .gguf file, read it back: {name: (raw bytes, torch shape, type)}."""
    write_gguf(path, {name: (weight, qtype) for name, weight in weights.items()})
    return read_gguf(path)


class GGMLTensor(torch.Tensor):
    """ComfyUI-GGUF's legacy weight: raw GGUF bytes with ``tensor_type`` and ``tensor_shape`` (GGMLOps loaders)."""

    def __new__(cls, data, tensor_type, tensor_shape):
        tensor = torch.Tensor._make_subclass(cls, data)
        tensor.tensor_type, tensor.tensor_shape = tensor_type, tensor_shape
        return tensor

    def detach(self, *args, **kwargs):
        return self  # as ComfyUI-GGUF's: nn.Parameter(weight) then keeps the tensor and its GGUF type


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


# --- Music 3's graphed AR loop on the CPU (tests/test_music3_graphs_comfyui.py, the mutated cores) -------------------

PROMPT = [[151669, 100, 200, 300, 151670, 151671, 151672]]
FRAMES = 6
GGUF_LAYER = 1


@contextlib.contextmanager
def emulated_graphs(prefetch):
    """Music 3's graphed path on the CPU (hotfix_testing/emulated_graphs.py) with the emulated capture rules, where a
    tensor made from Python data is the host copy it is on a GPU."""
    with emulated_graph_path(prefetch, lambda: emulated_capture(host_data_is_copy=True)) as emulation:
        yield emulation


def music3_text_encoder(music, q4_0_weight=None, units="get_dynamic_vram__units"):
    """A tiny real Music 3 text encoder of ``music`` (the core's ``comfy.text_encoders.minimax_music``) with seeded
    weights; with ``q4_0_weight``, layer GGUF_LAYER's MLP down_proj holds that GGUF weight. Each dynamic-VRAM unit the
    encoder's ``units`` method names (None: it has none) gets the ``_v_block`` mark that ``ModelPatcherDynamic.load``
    gives its first root on a CUDA machine."""
    torch.manual_seed(0)
    encoder = music.MiniMaxMusic3TEModel(device="cpu", model_options={}, projection_config=TINY_MUSIC3_CONFIG)
    with torch.no_grad():
        for parameter in encoder.parameters():
            values = torch.randn(parameter.shape)
            parameter.copy_(values * 0.05 if parameter.ndim > 1 else 1 + values * 0.1)
    if q4_0_weight is not None:
        encoder.model.layers[GGUF_LAYER].mlp.down_proj.weight = torch.nn.Parameter(q4_0_weight, requires_grad=False)
    for unit in [unit for group in (getattr(encoder, units)() if units else ()) for unit in group]:
        (unit[0] if isinstance(unit, (list, tuple)) else unit)._v_block = ("vbar block",)
    return encoder


def generate(encoder, graphs, enabled):
    graphs.enabled = enabled
    graphs.reset()
    with torch.no_grad():
        return encoder.generate(torch.tensor(PROMPT), seed=3, max_audio_frames=FRAMES, device=torch.device("cpu"))


def gguf_q4_0_down_proj(folder):
    """A GGUF Q4_0 weight for layer GGUF_LAYER's down_proj, written to and read back from ``folder``."""
    import gguf

    torch.manual_seed(1)
    weight = torch.randn(TINY_MUSIC3_CONFIG["hidden_size"], TINY_MUSIC3_CONFIG["intermediate_size"]) * 0.05
    raw, shape, _ = write_and_read_gguf(folder / "down.gguf", {"w": weight}, gguf.GGMLQuantizationType.Q4_0)["w"]
    return ggml_layout_tensor(raw, shape, gguf.GGMLQuantizationType.Q4_0)
