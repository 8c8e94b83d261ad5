"""int8_full_precision_mm on int8 "GGUF" files: a MiniMax H3 DiT whose tensors are GGUF ``I8`` (the "Q8" file of
molbal/MiniMax-H3-GGUF discussion #3, ``gguf qtypes: F32 (532), I8 (264)``) on a device without ``torch._int_mm``.

How ``I8`` tensors reach ``torch._int_mm`` (molbal/ComfyUI-GGUF, the fork that writes and loads these files; read at
loader.py 07700e18, nodes.py 23d3a019, ops.py 018ef1c6; docs/int8_full_precision_mm.md has the whole account):

* ``tools/convert.py`` writes a "Q8_CR" layer as an ``I8`` tensor (the ConvRot-rotated int8 payload), an ``F32``
  ``<weight>_scale`` and the layer's ``comfy_quant`` JSON as the metadata string ``comfy.gguf.quant.<weight>``.
* ``loader.py`` ``gguf_sd_loader`` turns each such layer back into ComfyUI's own int8 state dict (``weight`` int8,
  ``weight_scale``, a uint8 ``comfy_quant``) and reports ``gguf_quant_mode = "int8_convrot"``.
* ``nodes.py`` ``UnetLoaderGGUF.load_unet`` (and ``_legacy_gguf_ops`` of the Dynamic VRAM loader) then loads the DiT with
  ``custom_operations=get_gguf_q8_ops(compute_dtype=torch.bfloat16)()``.
* ``ops.py`` ``get_gguf_q8_ops``: ``GGUFQ8Ops.Linear`` subclasses ``comfy.ops.mixed_precision_ops({}, compute_dtype,
  full_precision_mm=False).Linear`` and loads through ``comfy.ops._load_quantized_module``: a ``QuantizedTensor``
  (``TensorWiseINT8Layout``) weight, whose forward is ComfyUI's int8 GEMM, and whose H3 MLP ``fc2`` goes through
  ``comfy.ops.linear_input_act``. Its own dequantized retry runs only where the loader set
  ``_gguf_q8_runtime_fallback`` (the Qwen3-VL text encoder on CUDA), never for the DiT. ``custom_operations`` bypasses
  ``pick_operations``, so not even a core with #16130 marks these layers ``_full_precision_mm``.

The stand-ins below reproduce that: the file written as ``tools/convert.py`` writes it, read as ``gguf_sd_loader``
reads it, the DiT built by ComfyUI's own ``load_diffusion_model_state_dict`` with ``GGUFQ8Ops``. Two parts of the fork
are left out because they change nothing here: its ``GGMLTensor`` wrapper of the ``F32`` tensors
(``load_state_dict`` copies them into the layers' own parameters, so the model holds plain tensors either way) and
``GGUFModelPatcher`` (a ``ModelPatcher`` whose GGML-specific paths skip weights without a GGML ``tensor_type``, which
the int8 ``QuantizedTensor`` weights are).
"""

import json
import os
import re
from collections import Counter

import numpy as np
import pytest
import torch

from hotfix_testing import synthetic_models
from hotfix_testing.comfy_memory import unload_all_models
from minimax_hotfix.diagnostics.self_tests.int8_full_precision_mm import MPS_INT_MM_ERROR
from minimax_hotfix.kernels.int8_full_precision_mm import MARK
from minimax_hotfix.patches.int8_full_precision_mm import FIX

QUANT_FIELD = "comfy.gguf.quant."  # + weight name: the layer's comfy_quant JSON
Q8_CR = {"format": "int8_tensorwise", "convrot": True, "weight_rotated": True,
         "convrot_groupsize": synthetic_models.CONVROT_GROUP}


def write_q8_cr_gguf(path, quantized: dict, int8_layers: list[str]) -> None:
    """``quantized`` (ComfyUI's int8 state dict) as a Q8_CR GGUF: ``tools/convert.py``'s layout for int8 layers,
    ``F32`` for every other tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "minimax_h3")
    for name, tensor in quantized.items():
        layer, _, kind = name.rpartition(".")
        if layer in int8_layers and kind in ("weight_scale", "comfy_quant"):
            continue  # written with the weight, as the converter writes them
        if layer in int8_layers and kind == "weight":
            writer.add_tensor(name, tensor.numpy(), raw_dtype=gguf.GGMLQuantizationType.I8)
            writer.add_tensor(f"{name}_scale", quantized[f"{layer}.weight_scale"].float().numpy(),
                              raw_dtype=gguf.GGMLQuantizationType.F32)
            writer.add_string(f"{QUANT_FIELD}{name}", json.dumps(Q8_CR))
        else:
            writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q8_cr_state_dict(path) -> tuple[dict, Counter]:
    """``gguf_sd_loader``'s state dict for a Q8_CR file, and its ``gguf qtypes`` counts."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    state, shapes, qtypes = {}, {}, Counter()
    for tensor in reader.tensors:
        shapes[tensor.name] = torch.Size(tuple(int(v) for v in reversed(tensor.shape)))
        data = torch.from_numpy(np.array(tensor.data))
        state[tensor.name] = data.view(shapes[tensor.name]) if tensor.tensor_type == gguf.GGMLQuantizationType.F32 \
            else data
        qtypes[tensor.tensor_type.name] += 1
    for field_name in reader.fields:
        if not field_name.startswith(QUANT_FIELD):
            continue
        field = reader.get_field(field_name)
        weight_key, conf = field_name[len(QUANT_FIELD):], str(field.parts[field.data[-1]], "utf-8")
        weight, scale = state[weight_key], state[f"{weight_key}_scale"]
        state[weight_key] = torch.nn.Parameter(weight.view(torch.int8).reshape(shapes[weight_key]),
                                               requires_grad=False)
        state[f"{weight_key}_scale"] = torch.nn.Parameter(scale.view(torch.float32).reshape(
            shapes[f"{weight_key}_scale"]), requires_grad=False)
        state[f"{weight_key[:weight_key.rfind('weight')]}comfy_quant"] = torch.nn.Parameter(
            torch.tensor(list(conf.encode("utf-8")), dtype=torch.uint8), requires_grad=False)
    return state, qtypes


def gguf_q8_ops(compute_dtype=torch.bfloat16):
    """``get_gguf_q8_ops(compute_dtype)()``: ComfyUI's mixed-precision Linear, created without a weight and loaded by
    ``_load_quantized_module`` (dense weights cast to ``compute_dtype`` first, as the fork's loader does)."""
    import comfy.ops

    base = comfy.ops.mixed_precision_ops(quant_config={}, compute_dtype=compute_dtype, full_precision_mm=False)

    class GGUFQ8Ops(base):
        class Linear(base.Linear):
            def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
                torch.nn.Module.__init__(self)
                self.factory_kwargs = {"device": device, "dtype": base._compute_dtype}
                self.in_features, self.out_features = in_features, out_features
                self.weight = None
                if bias:
                    self.bias = torch.nn.Parameter(torch.empty(out_features, **self.factory_kwargs))
                else:
                    self.register_parameter("bias", None)
                self._orig_shape = (out_features, in_features)
                self.tensor_class = None
                self._full_precision_mm = base._full_precision_mm
                self._full_precision_mm_config = False

            def _load_from_state_dict(self, *args):
                state_dict, prefix = args[:2]
                if f"{prefix}weight" in state_dict and f"{prefix}comfy_quant" not in state_dict:
                    state_dict[f"{prefix}weight"] = state_dict[f"{prefix}weight"].dequantize().to(
                        dtype=self.factory_kwargs["dtype"])
                return comfy.ops._load_quantized_module(
                    self, torch.nn.Module._load_from_state_dict.__get__(self, type(self)), *args,
                    load_extra_params=True)

    return GGUFQ8Ops()


def dit_inputs():
    """One sampling step's inputs for the tiny H3 DiT: a 4x4 latent frame, 4 stereo audio latents, 8 text tokens."""
    generator = torch.Generator().manual_seed(3)
    video = torch.randn(1, synthetic_models.INT8_TINY_DIT["latents_dim"], 1, 4, 4, generator=generator)
    audio = torch.randn(1, synthetic_models.INT8_TINY_DIT["audio_latents_dim"], 2, 4, generator=generator)
    context = torch.randn(1, 8, synthetic_models.INT8_TINY_DIT["text_dim"], generator=generator)
    return [video, audio], torch.tensor([500.0]), context


def sample_step(patcher):
    import comfy.model_management

    comfy.model_management.load_models_gpu([patcher], force_full_load=True)
    with torch.no_grad():
        return patcher.model.diffusion_model(*dit_inputs())


@pytest.mark.usefixtures("int_mm_missing", "unload")
@pytest.mark.cores("fixed int8")
def test_q8_cr_gguf_dit_red_then_green_through_apply_model(comfyui, tmp_path, registry):
    import comfy.model_management
    import comfy.sd

    from minimax_hotfix import nodes as pack_nodes

    registry(FIX)
    quantized, dequantized = synthetic_models.h3_int8_dit(torch.Generator().manual_seed(synthetic_models.SEED))
    int8_layers = [name[:-len(".comfy_quant")] for name in quantized if name.endswith(".comfy_quant")]
    path = tmp_path / "minimax_h3_fl2va_pruned-Q8_CR.gguf"
    write_q8_cr_gguf(path, quantized, int8_layers)
    state, qtypes = q8_cr_state_dict(path)
    stock = comfy.sd.load_diffusion_model_state_dict(state, model_options={"custom_operations": gguf_q8_ops()})
    expected = sample_step(comfy.sd.load_diffusion_model_state_dict(dequantized))
    unload_all_models()

    model = stock.model.diffusion_model
    assert all(type(model.get_submodule(layer).weight).__name__ == "QuantizedTensor" for layer in int8_layers)
    with pytest.raises(NotImplementedError) as red:
        sample_step(stock)  # red: the fork's DiT at sampler step 0
    assert str(red.value) == MPS_INT_MM_ERROR
    unload_all_models()

    (applied,) = pack_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixApplyModel"]().apply(model=stock)
    out = sample_step(applied)
    diverted = {layer for layer, module in model.named_modules() if MARK in module.__dict__}
    diffs = [(o - e).abs().max().item() for o, e in zip(out, expected, strict=True)]
    print(f"[{os.environ['COMFYUI_PATH']}] gguf qtypes: {', '.join(f'{k} ({v})' for k, v in qtypes.items())}; "
          f"{type(model.blocks[0].mlp.fc2).__qualname__}: without the pack NotImplementedError: {red.value}; "
          f"Apply MiniMax Hotfix (MODEL): {len(diverted)} layers diverted, max|fallback - dequantized reference| "
          f"= {max(diffs):.2e} (video, audio scale {[round(e.abs().max().item(), 1) for e in expected]})")
    assert qtypes == Counter({"F32": len(quantized) - 2 * len(int8_layers), "I8": len(int8_layers)})
    assert diverted == set(int8_layers)
    assert max(diffs) <= 1e-5 * max(e.abs().max().item() for e in expected)

    unload_all_models()
    with pytest.raises(NotImplementedError, match=re.escape(MPS_INT_MM_ERROR)):
        sample_step(stock)  # the loader's own MODEL is untouched by the Apply node's clone
