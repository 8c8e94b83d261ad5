"""int8_full_precision_mm on the MiniMax H3 int8 video VAE (``minimax_h3_video_vae_int8_convrot``), through the pack's
VAE loader and *Apply MiniMax Hotfix (VAE)*, on the running ComfyUI (CI: 0.33.0) and on the simulated "fixed int8"
core (#16130 + #16285 in ``comfy/ops.py``) through tests/test_simulated_cores.py.

The VAE is ComfyUI's own ``MiniMaxH3VideoVAE`` built by ``comfy.sd.VAE`` from an int8 ConvRot state dict (so its
decoder's transformer Linears come from ``mixed_precision_ops(quant_config, dtype)`` exactly as ``sd.py`` builds
them), at a small size: the real decoder (36 blocks of width 2048) does not run on a CPU test machine, so the test
narrows the decoder to 2 blocks of width 256 and the encoder to 32 base channels through the classes' own
constructor arguments. ``torch._int_mm`` raises the MPS error (a device without int8 compute).

Users swap in other int8 ConvRot video VAEs (``minimax_h3_lynnreal_light_vae_int8_convrot``: LynnReal's 26-block
decoder; ``minimax_h3_lightvae_lite_vae_int8_convrot``: LightVAE's 12-block Lite decoder), which cores with
Comfy-Org/ComfyUI#16657 / #17049 build at the depth the file has. The fix must hold for them by their layers, not by
the official file's structure: ``test_int8_vae_of_a_structure_never_seen_here`` loads a VAE of a depth, width, encoder
and int8 layer mix that no other file of the tests has, built at the file's own numbers as those cores do.
"""

import functools
import os
from pathlib import Path

import pytest
import torch

from hotfix_testing import synthetic_models
from minimax_hotfix.contract import State
from minimax_hotfix.diagnostics.self_tests.int8_full_precision_mm import MPS_INT_MM_ERROR, forget_int8_probes
from minimax_hotfix.kernels.int8_full_precision_mm import MARK
from minimax_hotfix.patches.int8_full_precision_mm import FIX, MODEL_KINDS

ROOT = Path(__file__).resolve().parents[1]
# The latent of one 32x32 frame: [batch, 24 channels, 1 latent frame, 2, 2]
LATENT_SHAPE = (1, 24, 1, 2, 2)


SMALL_DECODER, SMALL_VAE = {"num_layers": 2, "heads": 4}, {"ch": 32}
# Depth, width, encoder and int8 layers that no file of the tests has: 3 blocks of 8 heads x 64 (512 wide), an encoder
# of other widths with one residual block per level, and int8 on a mix of layers (all of block 0, block 1's
# feed-forward, block 2's attention; the rest dense).
UNSEEN_DECODER = {"num_layers": 3, "heads": 8, "dim_head": 64}
UNSEEN_VAE = {"ch": 32, "ch_mult": (1, 1, 2, 2, 4, 4), "num_res_blocks": 1}
UNSEEN_INT8_PREFIXES = ("decoder.transformer_blocks.0.", "decoder.transformer_blocks.1.ff.",
                        "decoder.transformer_blocks.2.attn.")


def h3_vae_classes(monkeypatch, decoder: dict, vae: dict):
    """``comfy.sd.VAE`` builds ComfyUI's real classes with these constructor arguments (what a core that reads the
    decoder's depth from the file does; 0.33.0 always builds the official 36 blocks)."""
    import comfy.ldm.minimax.vae as h3_vae

    monkeypatch.setattr(h3_vae, "ViT3DDecoder", functools.partial(h3_vae.ViT3DDecoder, **decoder))
    monkeypatch.setattr(h3_vae, "MiniMaxH3VideoVAE", functools.partial(h3_vae.MiniMaxH3VideoVAE, **vae))
    return h3_vae


def every_transformer_linear(name: str) -> bool:
    return name.startswith("decoder.transformer_blocks.")


def h3_vae_state_dicts(h3_vae, quantized=every_transformer_linear):
    """(int8 ConvRot state dict as an int8 VAE file stores it, the same VAE with those weights dequantized, the names
    of its int8 layers: the decoder's Linears for which ``quantized(name)`` says so)."""
    model = h3_vae.MiniMaxH3VideoVAE()
    generator = torch.Generator().manual_seed(0)
    dense = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("scale1") or name.endswith("scale2"):
            value = torch.full(tensor.shape, 0.5)
        elif tensor.dim() == 1 and name.endswith("weight"):
            value = torch.ones(tensor.shape)
        elif name.endswith("bias") or name.endswith("mask_token"):
            value = 0.02 * torch.randn(tensor.shape, generator=generator)
        elif name.startswith(("latents_", "pixel_")):
            value = tensor
        else:
            fan_in = tensor[0].numel() if tensor.dim() > 1 else 1
            value = torch.randn(tensor.shape, generator=generator) / fan_in ** 0.5
        # float16 values: an int8 file's dense layers hold their weights in float16 (sd.py's mixed_precision_ops
        # compute dtype), so only then is the float32 reference the same model
        dense[name] = value.half().float()
    int8_layers = [name for name, module in model.named_modules()
                   if quantized(name) and isinstance(module, torch.nn.Linear)]
    return (*synthetic_models.int8_convrot(model, dense, int8_layers), int8_layers)


def int8_vae_file(monkeypatch, tmp_path, file_name, decoder, vae, quantized=every_transformer_linear):
    """An int8 H3 video VAE file of that structure in a ``vae`` folder that ComfyUI's loaders read, the VAE built from
    its dequantized weights, and the names of its int8 layers."""
    import comfy.sd
    import folder_paths
    from safetensors.torch import save_file

    h3_vae = h3_vae_classes(monkeypatch, decoder, vae)
    quantized_state, dequantized, int8_layers = h3_vae_state_dicts(h3_vae, quantized)
    path = tmp_path / file_name
    save_file({name: tensor.contiguous() for name, tensor in quantized_state.items()}, str(path))
    monkeypatch.setattr(folder_paths, "get_full_path_or_raise",
                        lambda folder, name: str(path) if (folder, name) == ("vae", path.name) else None)
    return path.name, comfy.sd.VAE(sd=dequantized), int8_layers


@pytest.fixture
def h3_int8_vae_file(comfyui, monkeypatch, tmp_path):
    """A small int8 H3 video VAE file, its dense reference and its int8 layers."""
    return int8_vae_file(monkeypatch, tmp_path, "minimax_h3_video_vae_int8_convrot.safetensors", SMALL_DECODER,
                         SMALL_VAE)


@pytest.mark.fails_switched_off("int8_full_precision_mm", "The operator 'aten::_int_mm' is not currently implemented for the MPS device", cores=("fixed int8",))
def test_int8_vae_red_then_green_through_the_pack_vae_loader_and_apply_node(h3_int8_vae_file, int_mm_missing,
                                                                             unload, registry):
    import nodes as comfy_nodes
    from minimax_hotfix import nodes as pack_nodes

    registry(FIX)
    name, reference_vae, int8_layers = h3_int8_vae_file
    latent = torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(1))
    reference = reference_vae.decode(latent)

    (stock,) = comfy_nodes.VAELoader().load_vae(name)
    model = stock.first_stage_model
    assert all(type(model.get_submodule(layer).weight).__name__ == "QuantizedTensor" for layer in int8_layers)
    with pytest.raises(NotImplementedError, match=r"aten::_int_mm.*MPS"):
        stock.decode(latent)  # red: ComfyUI's own int8 VAE at VAE Decode

    (fixed,) = pack_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixVAELoader"]().load_vae(name)
    out = fixed.decode(latent)
    (applied,) = pack_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixApplyVAE"]().apply(vae=stock)
    via_apply = applied.decode(latent)
    diff = (out - reference).abs().max().item()
    print(f"[{os.environ['COMFYUI_PATH']}] int8 H3 VAE decode {tuple(out.shape)}, {len(int8_layers)} int8 layers: "
          f"max|fallback - dequantized reference| = {diff:.2e} (pixels in [0, 1])")
    assert out.shape == reference.shape and diff <= 1e-4
    inside = ((reference > 0) & (reference < 1)).float().mean().item()
    assert inside > 0.5, f"only {inside:.0%} of the reference pixels are unclamped: the comparison would say little"
    assert torch.equal(via_apply, out)
    with pytest.raises(NotImplementedError, match=r"aten::_int_mm.*MPS"):
        stock.decode(latent)  # the stock loader's VAE is untouched by the Apply node's copy


@pytest.mark.cores("fixed int8")
def test_int8_vae_of_a_structure_never_seen_here(comfyui, monkeypatch, tmp_path, int_mm_missing, unload, registry):
    """Red through the stock ``VAELoader``, green through the pack's VAE loader and *Apply MiniMax Hotfix (VAE)*, on a
    VAE of ``UNSEEN_DECODER`` / ``UNSEEN_VAE`` with int8 on ``UNSEEN_INT8_PREFIXES`` only: the fix diverts exactly the
    layers whose weight is int8, wherever they sit, and leaves the dense ones alone."""
    import nodes as comfy_nodes
    from minimax_hotfix import nodes as pack_nodes

    registry(FIX)
    name, reference_vae, int8_layers = int8_vae_file(
        monkeypatch, tmp_path, "minimax_h3_light_vae_int8_convrot.safetensors", UNSEEN_DECODER, UNSEEN_VAE,
        quantized=lambda layer: layer.startswith(UNSEEN_INT8_PREFIXES))
    latent = torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(2))
    reference = reference_vae.decode(latent)

    (stock,) = comfy_nodes.VAELoader().load_vae(name)
    model = stock.first_stage_model
    linears = {layer for layer, module in model.named_modules()
               if layer.startswith("decoder.transformer_blocks.") and hasattr(module, "in_features")}
    assert len(model.decoder.transformer_blocks) == UNSEEN_DECODER["num_layers"]
    assert {layer for layer in linears if type(model.get_submodule(layer).weight).__name__ == "QuantizedTensor"} == set(
        int8_layers)
    with pytest.raises(NotImplementedError) as red:
        stock.decode(latent)
    assert str(red.value) == MPS_INT_MM_ERROR

    (fixed,) = pack_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixVAELoader"]().load_vae(name)
    out = fixed.decode(latent)
    diverted = {layer for layer, module in fixed.first_stage_model.named_modules() if MARK in module.__dict__}
    (applied,) = pack_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixApplyVAE"]().apply(vae=stock)
    via_apply = applied.decode(latent)
    diff = (out - reference).abs().max().item()
    print(f"[{os.environ['COMFYUI_PATH']}] int8 VAE never seen here ({len(model.decoder.transformer_blocks)} blocks "
          f"{model.decoder.transformer_blocks[0].attn.to_out.in_features} wide, {len(int8_layers)} of {len(linears)} "
          f"Linears int8): stock VAELoader: NotImplementedError: {red.value}; pack's VAE loader: "
          f"max|fallback - dequantized reference| = {diff:.2e}, {len(diverted)} layers diverted")
    assert diverted == set(int8_layers)
    assert out.shape == reference.shape and diff <= 1e-4
    assert torch.equal(via_apply, out)


@pytest.mark.cores("fixed int8", "0.39 era")
def test_nothing_is_attached_where_the_core_dequantizes_the_layers_itself(comfyui, int_mm_missing, unload):
    """A model whose int8 layers are all marked ``_full_precision_mm`` gets the fix only on a core that does not
    honour the mark; on such a core the stock layers fail where the fix's would be, and on a core that honours it
    they compute."""
    import comfy.model_patcher
    import comfy.ops

    from minimax_hotfix.kernels.int8_full_precision_mm import tiny_int8_linear
    from minimax_hotfix.registry import key_for

    layer = tiny_int8_linear(comfy.ops, 64, 16, full_precision_mm=True)
    patcher = comfy.model_patcher.ModelPatcher(torch.nn.ModuleList([layer]), load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    FIX.attach(patcher, key_for(FIX))
    attached = bool(patcher.get_injections(key_for(FIX)))
    try:
        layer(torch.randn(4, 64))
        stock_computes = True
    except NotImplementedError:
        stock_computes = False
    assert attached is not stock_computes, (attached, stock_computes)


def expected_kinds():
    """Each model kind's expected state on the running core, found by running that kind's stock int8 layer with
    ``torch._int_mm`` missing (the test's own check, not the fix's reference comparison)."""
    import comfy.model_management
    import comfy.ops

    from minimax_hotfix.kernels.int8_full_precision_mm import tiny_int8_linear

    expected = {}
    for kind in MODEL_KINDS:
        layer = tiny_int8_linear(comfy.ops, 64, 16, **kind.options(comfy.model_management))
        x = torch.randn(4, 128)
        try:
            layer(comfy.ops.INPUT_ACT_EAGER["swiglu"](x))
            comfy.ops.linear_input_act(layer, x, "swiglu")
            expected[kind.name] = "fixed upstream"
        except (NotImplementedError, TypeError):  # TypeError: a newer core's kernel call on an older comfy-kitchen
            expected[kind.name] = "needs it"
    return expected


@pytest.mark.cores("fixed int8", "0.39 era")
def test_status_per_model_kind_follows_the_running_core(comfyui, int_mm_missing):
    expected = expected_kinds()
    forget_int8_probes()
    found = FIX.detect()
    print(f"[{os.environ['COMFYUI_PATH']}] {FIX.id}: {found.state.value}")
    for part in found.reason.split("; "):
        print(f"    {part}")
    for kind in MODEL_KINDS:
        assert f"{kind.name} ({kind.target}) {expected[kind.name]}" in found.reason, (kind.name, found.reason)
    all_fixed = all(state == "fixed upstream" for state in expected.values())
    assert found.state is (State.FIXED_UPSTREAM if all_fixed else State.NEEDED)
    assert expected["MiniMax H3 video VAE"] == "needs it", "no core seen so far dequantizes the VAE's int8 layers"
