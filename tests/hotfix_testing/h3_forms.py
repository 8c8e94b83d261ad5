"""The tiny overflowing MiniMax H3 of ``kernels/h3_fp16.py`` in each checkpoint form people run, as ComfyUI loads it:
bf16 (dense), fp8_scaled (float8_e4m3fn weights, per-tensor ``weight_scale`` and ``input_scale``, the ``comfy_quant``
entry), int8_convrot (``synthetic_models.int8_convrot``), and GGUF Q8_0 / Q4_K (a .gguf file written by
``ggml_layout.write_gguf``, read back as ComfyUI-GGUF's Dynamic VRAM loader hands it to ComfyUI: GGMLLayout
``QuantizedTensor`` weights). Every form goes through ComfyUI's own ``load_diffusion_model_state_dict`` (detection,
``quant_config`` from the ``.comfy_quant`` entries, ``pick_operations``). Its widths are ``FORMS_TINY_H3``: ConvRot
and Q4_K need input features in multiples of 256."""

from __future__ import annotations

import json
from unittest import mock

import torch

from hotfix_testing import synthetic_models
from hotfix_testing.ggml_layout import gguf_state_dict, write_gguf

FORMS = ("bf16", "fp8_scaled", "int8_convrot", "gguf_Q8_0", "gguf_Q4_K")
FP8 = {"format": "float8_e4m3fn"}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def forms_config() -> dict:
    """The tiny H3's widths (``TINY_H3``) with every projection 256 wide: hidden 8 heads x 32, the MLP 256."""
    from minimax_hotfix.kernels.h3_fp16 import TINY_H3

    return {**TINY_H3, "hidden_size": 256, "num_attention_heads": 8, "ffn_hidden_size": 256}


def overflow_state() -> tuple[torch.nn.Module, dict]:
    """(the tiny H3 declared on ``meta``, its fp32 ``tiny_h3_state`` with the overflow structure)."""
    from minimax_hotfix.kernels.h3_fp16 import tiny_h3_state

    model = synthetic_models.h3_dit_model(forms_config())
    return model, tiny_h3_state(model, overflow=True)


def comfy_quant(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def fp8_scaled(state: dict, layers: list[str], input_amax: dict[str, float]) -> dict:
    """``layers`` as an fp8_scaled checkpoint stores them: float8_e4m3fn ``weight``, per-tensor ``weight_scale``
    (amax / 448), a static ``input_scale`` calibrated on ``input_amax`` (the layer's largest input), the
    ``comfy_quant`` entry; the other tensors bf16."""
    out = {name: value.to(torch.bfloat16) for name, value in state.items()}
    for name in layers:
        weight = state[f"{name}.weight"].float()
        scale = weight.abs().amax() / FP8_MAX
        out[f"{name}.weight"] = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[f"{name}.weight_scale"] = scale.reshape(())
        out[f"{name}.input_scale"] = torch.tensor(input_amax[name] / FP8_MAX)
        out[f"{name}.comfy_quant"] = comfy_quant(FP8)
    return out


def gguf_file(path, state: dict, layers: list[str], qtype) -> dict:
    """``state`` as a .gguf file, ``layers``' weights in ``qtype``, every other tensor F32 (ComfyUI-GGUF keeps norms
    and small tensors unquantized), read back as ComfyUI-GGUF's Dynamic VRAM loader gives it to ComfyUI."""
    import gguf

    f32 = gguf.GGMLQuantizationType.F32
    write_gguf(path, {name: (value, qtype if name[:-len(".weight")] in layers and name.endswith(".weight") else f32)
                      for name, value in state.items()})
    return gguf_state_dict(path)


def layer_inputs_amax(model: torch.nn.Module, layers: list[str], run) -> dict[str, float]:
    """The largest input magnitude each of ``layers`` sees in ``run(model)`` (an fp32 call): an fp8 checkpoint's
    calibration."""
    seen = {}
    handles = [model.get_submodule(name).register_forward_pre_hook(
        lambda module, args, name=name: seen.__setitem__(name, max(seen.get(name, 0.0),
                                                                   args[0].abs().max().item())))
        for name in layers]
    try:
        run(model)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def dit_call(model, inputs: dict) -> torch.Tensor:
    """One DiT call, its video and audio outputs flattened into one fp32 vector."""
    with torch.no_grad():
        return torch.cat([part.reshape(-1).to(torch.float32) for part in model(**inputs)])


def inputs_in(dtype: torch.dtype) -> dict:
    """``tiny_h3_inputs`` (fp16 values, as ComfyUI hands an fp16 call its inputs) in ``dtype``."""
    from minimax_hotfix.kernels.h3_fp16 import tiny_h3_inputs

    inputs = tiny_h3_inputs(torch.float16)
    return {**inputs, "x": [part.to(dtype) for part in inputs["x"]], "context": inputs["context"].to(dtype)}


def load(state: dict, model_options: dict | None = None, gguf: bool = False):
    """``state`` through ComfyUI's ``load_diffusion_model_state_dict``; ``gguf``: under dynamic VRAM, as
    ComfyUI-GGUF's Dynamic VRAM loaders require (the layers take the GGMLLayout weights as they are)."""
    import comfy.memory_management
    import comfy.sd

    with mock.patch.object(comfy.memory_management, "aimdo_enabled", gguf or comfy.memory_management.aimdo_enabled):
        return comfy.sd.load_diffusion_model_state_dict(dict(state), model_options=model_options or {})


def form_state_dict(form: str, tmp_path) -> dict:
    """The tiny overflowing H3 in ``form``, as the file's state dict reaches ComfyUI's loader."""
    import gguf

    model, state = overflow_state()
    layers = synthetic_models.rotatable_linears(model)
    if form == "bf16":
        return {name: value.to(torch.bfloat16) for name, value in state.items()}
    if form == "fp8_scaled":
        dense = load(state).model.diffusion_model
        return fp8_scaled(state, layers, layer_inputs_amax(dense, layers,
                                                           lambda module: dit_call(module, inputs_in(torch.float32))))
    if form == "int8_convrot":
        return synthetic_models.int8_convrot(model, state, layers)[0]
    qtype = {"gguf_Q8_0": gguf.GGMLQuantizationType.Q8_0, "gguf_Q4_K": gguf.GGMLQuantizationType.Q4_K}[form]
    return gguf_file(tmp_path / f"tiny_h3_{form}.gguf", state, layers, qtype)
