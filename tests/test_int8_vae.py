"""int8_full_precision_mm on the MiniMax H3 int8 video VAE (``minimax_h3_video_vae_int8_convrot``), through the pack's
VAE loader and *Apply MiniMax Hotfix (VAE)*, on the running ComfyUI (CI: 0.33.0) and on the simulated "fixed int8"
core (#16130 + #16285 in ``comfy/ops.py``) through tests/test_simulated_cores.py.

The VAE is ComfyUI's own ``MiniMaxH3VideoVAE`` built by ``comfy.sd.VAE`` from an int8 ConvRot state dict (so its
decoder's transformer Linears come from ``mixed_precision_ops(quant_config, dtype)`` exactly as ``sd.py`` builds
them), at a small size: the real decoder (36 blocks of width 2048) does not run on a CPU test machine, so the test
narrows the decoder to 2 blocks of width 256 and the encoder to 32 base channels through the classes' own
constructor arguments. ``torch._int_mm`` raises the MPS error (a device without int8 compute).
"""

import functools
import os
from pathlib import Path

import pytest
import synthetic_models
import torch

from minimax_hotfix.diagnostics.self_tests.int8_full_precision_mm import MPS_INT_MM_ERROR
from minimax_hotfix.kernels.int8_full_precision_mm import forget_int8_probes
from minimax_hotfix.patches.int8_full_precision_mm import FIX, MODEL_KINDS
from minimax_hotfix.registry.contract import State

ROOT = Path(__file__).resolve().parents[1]
# The latent of one 32x32 frame: [batch, 24 channels, 1 latent frame, 2, 2]
LATENT_SHAPE = (1, 24, 1, 2, 2)


def small_h3_vae_classes(monkeypatch):
    """``comfy.sd.VAE`` builds ComfyUI's real classes, narrowed through their constructor arguments."""
    import comfy.ldm.minimax.vae as h3_vae

    monkeypatch.setattr(h3_vae, "ViT3DDecoder", functools.partial(h3_vae.ViT3DDecoder, num_layers=2, heads=4))
    monkeypatch.setattr(h3_vae, "MiniMaxH3VideoVAE", functools.partial(h3_vae.MiniMaxH3VideoVAE, ch=32))
    return h3_vae


def h3_vae_state_dicts(h3_vae):
    """(int8 ConvRot state dict as the int8 VAE file stores it, the same VAE with those weights dequantized)."""
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
        dense[name] = value.float()
    int8_layers = [name for name, module in model.named_modules()
                   if name.startswith("decoder.transformer_blocks.") and isinstance(module, torch.nn.Linear)]
    return (*synthetic_models.int8_convrot(model, dense, int8_layers), int8_layers)


@pytest.fixture
def h3_int8_vae_file(comfyui, monkeypatch, tmp_path):
    """A small int8 H3 video VAE file in a ``vae`` folder that ComfyUI's loaders read, and its dense reference."""
    import comfy.sd
    import folder_paths
    from safetensors.torch import save_file

    h3_vae = small_h3_vae_classes(monkeypatch)
    quantized, dequantized, int8_layers = h3_vae_state_dicts(h3_vae)
    path = tmp_path / "minimax_h3_video_vae_int8_convrot.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in quantized.items()}, str(path))
    monkeypatch.setattr(folder_paths, "get_full_path_or_raise",
                        lambda folder, name: str(path) if (folder, name) == ("vae", path.name) else None)
    return path.name, comfy.sd.VAE(sd=dequantized), int8_layers


@pytest.fixture
def int_mm_missing(monkeypatch):
    def missing(*args, **kwargs):
        raise NotImplementedError(MPS_INT_MM_ERROR)

    monkeypatch.setattr(torch, "_int_mm", missing)
    forget_int8_probes()
    yield
    forget_int8_probes()


@pytest.fixture
def unload():
    import comfy.model_management

    yield
    comfy.model_management.unload_all_models()
    FIX.unwrap_linear_input_act()


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
