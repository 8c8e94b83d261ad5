"""Synthetic model files for running the bundled workflows on a real ComfyUI: random weights from a fixed seed, in
the official key layout and under the file names the workflows use, so that ComfyUI's own detection builds the
real model classes. Shapes come from ComfyUI's own modules (built on ``meta``), so they match the ComfyUI at hand.

ComfyUI hard-codes the size of some models, far beyond a 2-core CPU: MiniMax Music 3's text encoder
(``comfy.text_encoders.minimax_music.MODEL_CONFIG``, about 10 B parameters), the H3 text encoder (Qwen3-VL-32B cut to
50 layers, ``Qwen3VL_32BConfig`` and ``QWEN3VL_VISION``), the H3 video VAE (2.60 B parameters, the
defaults of ``MiniMaxH3VideoVAE`` and of its ``ViT3DDecoder``) and the H3 audio VAE (151 M parameters, the defaults of
``MiniMaxH3AudioVAE``). Their files are written for the tiny configurations of ``TINY_CONFIGS`` instead, and the
server that loads them applies the same numbers (``comfyui_probe`` starts ``tiny_config_patches()``). The Music 3 DAV
is written at its real size (54 M parameters): ComfyUI reads nothing from its shapes.

``write_int8_models`` writes the H3 DiT and video VAE as the real files are, int8 ConvRot, into a models folder of
their own, with their dense (dequantized) copies in another: ConvRot rotates groups of 256 input features, wider than
the tiny models, so those are 256 wide there (``INT8_TINY_DIT``; the decoder's width, which ComfyUI does not read from
the file, in the folder's ``TINY_CONFIGS_FILE``, which the probe applies over ``TINY_CONFIGS``).
``write_vision_tower_models`` writes what the H3 reference-to-video conditioning loads into a folder of its own, the
text encoder with wider MLPs (``VISION_TOWER_TINY_CONFIGS``), so that a budget splits it.
``write_h3_fp16_models`` writes the H3 models with a DiT whose activations leave fp16's range as the real model's do
(``H3_FP16_TINY_DIT``, ``h3_fp16_overflow_dit``) into a folder of its own, with that DiT's Q8_0 GGUF form and its int8
ConvRot form (``H3_FP16_INT8_TINY_DIT``, 256 wide for ConvRot's groups) beside it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

SEED = 20260901
# keyword arguments ComfyUI leaves at their defaults; the latent channels and the temporal and spatial ratios stay real
TINY_CONFIGS = {
    # MLPs wide enough (32 KiB a matrix in bfloat16, 18 KiB in Q4_0) that ComfyUI's dynamic VRAM load streams them
    # through the vbar rather than force-loading them (it force-loads modules of 16 KiB or less), so that it marks
    # each Llama layer as a CUDA-graph unit (``_v_block``), as it marks the real model's
    "comfy.text_encoders.minimax_music.MODEL_CONFIG": {
        "hidden_size": 32, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "decoder_num_heads": 2, "decoder_intermediate_size": 64, "decoder_num_layers": 1},
    "comfy.ldm.minimax.vae.MiniMaxH3VideoVAE": {"ch": 32, "ch_mult": (1, 1, 1, 1, 1, 1), "num_res_blocks": 1},
    "comfy.ldm.minimax.vae.ViT3DDecoder": {"num_layers": 1, "heads": 2, "dim_head": 32},
    "comfy.ldm.minimax.audio_vae.MiniMaxH3AudioVAE": {"encoder_dim": 4, "latent_dim": 64, "decoder_dim": 128},
    # the H3 text encoder keeps its 50 layers (ComfyUI detects it by layer 49), its vocabulary (the vision markers'
    # ids) and its head size (the MRoPE sections are a class attribute); the tower keeps its patch and merge sizes;
    # its width is the tiny DiT's text width (H3_TINY_DIT) and its tokenizer ComfyUI's own (qwen25_tokenizer)
    "comfy.text_encoders.llama.Qwen3VL_32BConfig": {"hidden_size": 64, "intermediate_size": 64,
                                                    "num_attention_heads": 2, "num_key_value_heads": 1},
    "comfy.text_encoders.qwen3vl.QWEN3VL_VISION": {
        "qwen3vl_32b": {"hidden_size": 64, "intermediate_size": 128, "depth": 3, "deepstack_visual_indexes": [0, 1, 2]}},
}
MUSIC3_TEXT_ENCODER_FILE = "minimax_music3_text_encoder_pruned_int8_convrot.safetensors"
MUSIC3_DAV_FILE = "minimax_music3_dav.safetensors"
# the GGUF Music 3 text encoder of seed 002 (the bundled GGUF workflow's name): the same weights, layer MUSIC3_Q4_0_LAYER
# quantized to Q4_0 (ComfyUI-GGUF dequantizes it on every call), the others bfloat16, the norms float32
MUSIC3_GGUF_TEXT_ENCODER_FILE = "minimax_music3_text_encoder_pruned_Q4_0.gguf"
MUSIC3_Q4_0_LAYER = 1
H3_VIDEO_VAE_FILE = "minimax_h3_video_vae_int8_convrot.safetensors"
H3_AUDIO_VAE_FILE = "minimax_h3_audio_vae_fp32.safetensors"
H3_TEXT_ENCODER_FILE = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"  # the workflows' name; written in bfloat16
H3_DIT_FILES = ("minimax_h3_fl2va_pruned_int8_convrot.safetensors", "minimax_h3_ref2va_pruned_int8_convrot.safetensors")
# ComfyUI reads every one of these from the H3 DiT file's shapes; latents_dim and audio_latents_dim keep the real
# latent formats' channel counts; the rope rotates 3 axes x 2 x rope_inv_freq_len of each head's dimensions
H3_TINY_DIT = {"hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 1, "num_attention_heads": 2,
               "attention_head_dim": 32, "ffn_hidden_size": 128, "latents_dim": 24, "audio_latents_dim": 32,
               "text_dim": 64, "timestep_input_dim": 256, "time_embed_hidden_size": 64, "time_embed_dim": 32,
               "rope_inv_freq_len": 4}
CONVROT_GROUP = 256
CONVROT = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": CONVROT_GROUP}
INT8_TINY_DIT = {**H3_TINY_DIT, "hidden_size": 256, "num_attention_heads": 8, "ffn_hidden_size": 512}
INT8_TINY_CONFIGS = {"comfy.ldm.minimax.vae.ViT3DDecoder": {"heads": 8}}  # width 8 x 32
# ComfyUI reserves an offload buffer of about three times the largest module (the 151936-row vocabulary, cast from
# bfloat16 to float32) before it keeps any weight of a partially loaded model; the tiny encoder, mostly vocabulary,
# then loads all or nothing. Wider MLPs (50 layers x 3 x 64 x 3072) make the layers outweigh that buffer, so that a
# budget between the two splits the encoder.
VISION_TOWER_TINY_CONFIGS = {"comfy.text_encoders.llama.Qwen3VL_32BConfig": {"intermediate_size": 3072}}
TINY_CONFIGS_FILE = "tiny_configs.json"  # in a models folder: its models' TINY_CONFIGS changes
# The DiT of the fp16 runs: wider than the text states, as the real model is (5376 against Qwen3-VL's 5120), so that
# condition_proj and the token refiner run; at H3_TINY_DIT's equal widths ComfyUI's DiT skips both.
H3_FP16_TINY_DIT = {**H3_TINY_DIT, "hidden_size": 128, "num_attention_heads": 4}
# The tiny text encoder's states carry no massive activation (the real Qwen3-VL's first token: about 300 in one
# channel; here every channel is within about 25). Its channel 22 is negative on every token of the bundled
# workflows' and the official templates' prompts (measured: -1.4 to -25, typically -9), so condition_proj's massive
# row reads that channel, scaled so that a typical token reaches the real model's peak.
TINY_ENCODER_NEGATIVE_CHANNEL = 22
TINY_ENCODER_TYPICAL_VALUE = -9.0
# The other forms of that DiT users load: a Q8_0 GGUF (ComfyUI-GGUF's UnetLoaderGGUF), and the int8 ConvRot file of
# the official name, 256 wide (ConvRot rotates groups of 256 input features), in a folder of its own: the bundled
# workflow keeps the bfloat16 DiT under that name
H3_FP16_GGUF_FILE = "minimax_h3_fl2va_Q8_0.gguf"
H3_FP16_INT8_TINY_DIT = {**H3_FP16_TINY_DIT, "hidden_size": 256, "num_attention_heads": 8, "ffn_hidden_size": 512}
H3_FP16_INT8_DIT_FILE = f"int8_convrot/{H3_DIT_FILES[0]}"


def tiny_configs_of(models_dir: Path | None) -> dict:
    """``TINY_CONFIGS`` with the changes of ``models_dir``'s ``TINY_CONFIGS_FILE`` (where it has one)."""
    changes = json.loads((models_dir / TINY_CONFIGS_FILE).read_text()) if models_dir and (
        models_dir / TINY_CONFIGS_FILE).is_file() else {}
    return {target: {**values, **changes.get(target, {})} for target, values in TINY_CONFIGS.items()}


def tiny_config_patches(models_dir: Path | None = None) -> list:
    """Patchers (``unittest.mock``) that make ComfyUI build the tiny sizes of ``tiny_configs_of(models_dir)``: a
    dictionary updated, or a class whose ``__init__`` gets the tiny values as defaults (arguments a caller passes
    still win)."""
    import importlib

    patchers = []
    for target, values in tiny_configs_of(models_dir).items():
        module_name, name = target.rsplit(".", 1)
        owner = getattr(importlib.import_module(module_name), name)
        if isinstance(owner, dict):
            patchers.append(mock.patch.dict(owner, values))
        else:
            patchers.append(mock.patch.object(owner, "__init__", functools.partialmethod(owner.__init__, **values)))
    return patchers


@contextlib.contextmanager
def tiny_configs(models_dir: Path | None = None):
    with contextlib.ExitStack() as stack:
        for patcher in tiny_config_patches(models_dir):
            stack.enter_context(patcher)
        yield


def random_like(shape: torch.Size, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Scaled so activations stay finite through deep stacks: 1/sqrt(fan-in) for matrices, about 1 for vectors
    (norm scales, weight-norm magnitudes, snake alphas)."""
    if len(shape) < 2:
        values = 1.0 + 0.05 * torch.randn(shape, generator=generator)
    else:
        values = torch.randn(shape, generator=generator) / math.sqrt(math.prod(shape[1:]))
    return values.to(dtype)


def random_state_dict(module: torch.nn.Module, dtype: torch.dtype, generator: torch.Generator) -> dict:
    return {key: random_like(value.shape, dtype, generator) for key, value in module.state_dict().items()}


def music3_tokenizer_json() -> bytes:
    """A word-level tokenizer whose special tokens have Music 3's ids (ComfyUI checks them on load); every other
    word is one of a few ids below the audio code range."""
    from comfy.ldm.minimax_music.prompt import SPECIAL_TOKEN_IDS
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{word: index + 1 for index, word in enumerate("the a and of to in on with".split())},
             **SPECIAL_TOKEN_IDS}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(SPECIAL_TOKEN_IDS))
    return tokenizer.to_str().encode("utf-8")


def music3_text_encoder(generator: torch.Generator) -> dict:
    """The pruned layout (``embed_tokens_prefill``/``lm_head_pruned``, as the official pruned file) plus the
    tokenizer ComfyUI reads from the checkpoint."""
    from comfy.text_encoders import minimax_music

    with tiny_configs(), torch.device("meta"):
        model = minimax_music.MiniMaxMusic3TEModel(device="meta")
    state = random_state_dict(model, torch.bfloat16, generator)
    del state["model.embed_tokens.weight"], state["model.lm_head.weight"]
    state["tokenizer_json"] = torch.frombuffer(bytearray(music3_tokenizer_json()), dtype=torch.uint8)
    return state


def music3_dav(generator: torch.Generator) -> dict:
    """Full size; weight-norm tensors under the official ``weight_g``/``weight_v`` names, which ComfyUI detects."""
    import comfy.ops
    from comfy.ldm.minimax_music.dav import MiniMaxMusic3DAV

    with torch.device("meta"):
        model = MiniMaxMusic3DAV(operations=comfy.ops.disable_weight_init)
    state = random_state_dict(model, torch.float16, generator)
    official = {".parametrizations.weight.original0": ".weight_g", ".parametrizations.weight.original1": ".weight_v"}
    for key in list(state):
        for ours, theirs in official.items():
            if key.endswith(ours):
                state[key[:-len(ours)] + theirs] = state.pop(key)
    return state


def h3_dit_model(config: dict = H3_TINY_DIT) -> torch.nn.Module:
    import comfy.ops
    from comfy.ldm.minimax.model import MiniMaxH3Model

    with torch.device("meta"):
        return MiniMaxH3Model(**config, dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init)


def h3_dit(generator: torch.Generator) -> dict:
    return random_state_dict(h3_dit_model(), torch.bfloat16, generator)


def h3_text_encoder(generator: torch.Generator, models_dir: Path | None = None) -> dict:
    """The converted checkpoint's layout (``model.*`` language model, ``visual.*`` tower, no lm_head), tiny (with
    the changes of ``models_dir``'s ``TINY_CONFIGS_FILE``)."""
    from comfy.text_encoders import minimax

    with tiny_configs(models_dir), torch.device("meta"):
        model = minimax.MiniMaxH3TEModel(device="meta", dtype=torch.bfloat16)
    return random_state_dict(model.qwen3vl_32b.transformer, torch.bfloat16, generator)


def h3_video_vae_model(models_dir: Path | None = None) -> torch.nn.Module:
    import comfy.ops
    from comfy.ldm.minimax.vae import MiniMaxH3VideoVAE

    with tiny_configs(models_dir), torch.device("meta"):
        return MiniMaxH3VideoVAE(operations=comfy.ops.disable_weight_init)


def h3_video_vae(generator: torch.Generator) -> dict:
    """Tiny, unquantized float16 (the real file is int8 convrot); ComfyUI detects it by its key names."""
    return random_state_dict(h3_video_vae_model(), torch.float16, generator)


def int8_convrot(model: torch.nn.Module, state: dict, layers: list[str]) -> tuple[dict, dict]:
    """(``state`` with ``layers``' weights int8 ConvRot, as comfy-kitchen quantizes them and ComfyUI reads them:
    int8 ``weight``, per-channel ``weight_scale``, the ``comfy_quant`` entry; ``state`` with those weights
    dequantized, float32): the same model, once as the int8 file and once dense."""
    from comfy.quant_ops import QuantizedTensor

    quantized, dense = dict(state), dict(state)
    for name in layers:
        weight = QuantizedTensor.from_float(state[f"{name}.weight"].float(), "TensorWiseINT8Layout", per_channel=True,
                                            convrot=True, convrot_groupsize=CONVROT_GROUP)
        quantized[f"{name}.weight"], quantized[f"{name}.weight_scale"] = weight._qdata, weight._params.scale
        quantized[f"{name}.comfy_quant"] = torch.tensor(list(json.dumps(CONVROT).encode()), dtype=torch.uint8)
        dense[f"{name}.weight"] = weight.dequantize().float()
    return quantized, dense


def rotatable_linears(model: torch.nn.Module, prefix: str = "") -> list[str]:
    """The Linears under ``prefix`` whose input features ConvRot's groups divide."""
    return [name for name, module in model.named_modules() if name.startswith(prefix)
            and isinstance(module, torch.nn.Linear) and module.in_features % CONVROT_GROUP == 0]


def h3_int8_dit(generator: torch.Generator) -> tuple[dict, dict]:
    model = h3_dit_model(INT8_TINY_DIT)
    return int8_convrot(model, random_state_dict(model, torch.bfloat16, generator), rotatable_linears(model))


def h3_int8_video_vae(generator: torch.Generator, models_dir: Path) -> tuple[dict, dict]:
    """The decoder's transformer Linears int8, as in the real file."""
    model = h3_video_vae_model(models_dir)
    state = random_state_dict(model, torch.float16, generator)
    return int8_convrot(model, state, rotatable_linears(model, "decoder.transformer_blocks."))


AUDIO_RESIDUAL_BRANCH_SCALE = 0.25


def h3_audio_vae(generator: torch.Generator) -> dict:
    """Random weights, well conditioned as a trained decoder is: the model's own anti-aliasing filters (built on the
    CPU, where its constructor computes them), as the real checkpoint carries them, and each residual branch's last
    conv scaled by AUDIO_RESIDUAL_BRANCH_SCALE, so that the 21 residual blocks stay near the identity. With random
    filters each of the decoder's 127 resampling steps is a random gain: its output then sits at the clamp (+-1)
    almost everywhere, each sample the sign of a sum of terms up to 5.4e5 whose fp32 rounding alone flips it (the
    first GPU run's 0.376: docs/testing.md, "The GPU check"; tests/test_gpu_check.py)."""
    from comfy.ldm.minimax.audio_vae import MiniMaxH3AudioVAE

    with tiny_configs():
        model = MiniMaxH3AudioVAE()
    state = random_state_dict(model, torch.float32, generator)
    state.update({key: value * AUDIO_RESIDUAL_BRANCH_SCALE for key, value in state.items()
                  if ".convs2." in key and key.endswith(".weight")})
    return {**state, **{key: value for key, value in model.state_dict().items() if key.endswith(".filter")}}


def music3_gguf_text_encoder(models_dir: Path, state: dict) -> Path:
    """The Music 3 text encoder ``state`` as a GGUF file (MUSIC3_GGUF_TEXT_ENCODER_FILE), its tokenizer as int8."""
    import gguf

    from hotfix_testing.ggml_layout import write_gguf

    types = gguf.GGMLQuantizationType

    def ggml_type(name: str, tensor: torch.Tensor):
        if not tensor.is_floating_point():
            return types.I8
        if tensor.ndim == 1:
            return types.F32
        return types.Q4_0 if name.startswith(f"model.layers.{MUSIC3_Q4_0_LAYER}.") else types.BF16

    path = models_dir / "text_encoders" / MUSIC3_GGUF_TEXT_ENCODER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(path, {name: (tensor.view(torch.int8) if tensor.dtype == torch.uint8 else tensor, ggml_type(name, tensor))
                      for name, tensor in state.items()})
    return path


def save_model(models_dir: Path, folder: str, name: str, state: dict) -> Path:
    path = models_dir / folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in state.items()}, str(path))
    return path


def write_models(models_dir: Path) -> dict[str, Path]:
    """Writes every synthetic model under ``models_dir/<ComfyUI folder>/``; returns their paths by file name."""
    generator = torch.Generator().manual_seed(SEED)
    files = {("text_encoders", MUSIC3_TEXT_ENCODER_FILE): music3_text_encoder,
             ("vae", MUSIC3_DAV_FILE): music3_dav,
             ("text_encoders", H3_TEXT_ENCODER_FILE): h3_text_encoder,
             ("vae", H3_VIDEO_VAE_FILE): h3_video_vae, ("vae", H3_AUDIO_VAE_FILE): h3_audio_vae,
             **{("diffusion_models", name): h3_dit for name in H3_DIT_FILES}}
    paths = {name: save_model(models_dir, folder, name, build(generator)) for (folder, name), build in files.items()}
    paths[MUSIC3_GGUF_TEXT_ENCODER_FILE] = music3_gguf_text_encoder(
        models_dir, load_file(paths[MUSIC3_TEXT_ENCODER_FILE]))
    return paths


def write_int8_models(int8_dir: Path, dense_dir: Path) -> None:
    """The H3 models: DiT and video VAE int8 ConvRot in ``int8_dir``, their dense (dequantized) copies under the
    same names in ``dense_dir``, the text encoder and audio VAE in both; each folder's ``TINY_CONFIGS_FILE``."""
    for models_dir in (int8_dir, dense_dir):
        models_dir.mkdir(parents=True, exist_ok=True)
        (models_dir / TINY_CONFIGS_FILE).write_text(json.dumps(INT8_TINY_CONFIGS))
    generator = torch.Generator().manual_seed(SEED)
    pairs = {("text_encoders", H3_TEXT_ENCODER_FILE): lambda: (h3_text_encoder(generator),) * 2,
             ("vae", H3_VIDEO_VAE_FILE): lambda: h3_int8_video_vae(generator, int8_dir),
             ("vae", H3_AUDIO_VAE_FILE): lambda: (h3_audio_vae(generator),) * 2,
             **{("diffusion_models", name): lambda: h3_int8_dit(generator) for name in H3_DIT_FILES}}
    for (folder, name), build in pairs.items():
        for models_dir, state in zip((int8_dir, dense_dir), build(), strict=True):
            save_model(models_dir, folder, name, state)


def write_vision_tower_models(models_dir: Path) -> None:
    """What the H3 reference-to-video conditioning loads (text encoder, video and audio VAE), the encoder in its
    ``VISION_TOWER_TINY_CONFIGS`` widths (the folder's ``TINY_CONFIGS_FILE``), so that a budget splits it."""
    models_dir.mkdir(parents=True, exist_ok=True)
    (models_dir / TINY_CONFIGS_FILE).write_text(json.dumps(VISION_TOWER_TINY_CONFIGS))
    generator = torch.Generator().manual_seed(SEED)
    save_model(models_dir, "text_encoders", H3_TEXT_ENCODER_FILE, h3_text_encoder(generator, models_dir))
    save_model(models_dir, "vae", H3_VIDEO_VAE_FILE, h3_video_vae(generator))
    save_model(models_dir, "vae", H3_AUDIO_VAE_FILE, h3_audio_vae(generator))


def h3_fp16_overflow_dit(config: dict = H3_FP16_TINY_DIT) -> dict:
    """The ``config`` state of ``kernels/h3_fp16.py``'s ``tiny_h3_state`` with its overflow structure (the
    attention sink grown block by block, branch outputs past fp16's range), condition_proj's massive row reading the
    tiny encoder's ``TINY_ENCODER_NEGATIVE_CHANNEL``, so that its output on the text rows exceeds fp16's range as
    the real model's does (about 96k). bfloat16, as the real file; every weight inside fp16's range."""
    from minimax_hotfix.kernels.h3_fp16 import CONDITION_PROJ_PEAK, tiny_h3_state

    state = tiny_h3_state(h3_dit_model(config), overflow=True)
    massive_row = state["condition_proj.weight"][0]
    massive_row.zero_()
    massive_row[TINY_ENCODER_NEGATIVE_CHANNEL] = CONDITION_PROJ_PEAK / TINY_ENCODER_TYPICAL_VALUE
    return {key: value.to(torch.bfloat16) for key, value in state.items()}


def h3_fp16_overflow_gguf(path: Path, state: dict) -> None:
    """The DiT ``state`` as ComfyUI-GGUF's Q8_0 files hold a DiT: matrices Q8_0 (blocks of 32 input features), the
    other tensors F32."""
    import gguf

    from hotfix_testing.ggml_layout import write_gguf

    types = gguf.GGMLQuantizationType
    path.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(path, {name: (tensor, types.Q8_0 if tensor.ndim == 2 and tensor.shape[1] % 32 == 0 else types.F32)
                      for name, tensor in state.items()})


def h3_fp16_overflow_int8_dit() -> dict:
    """``h3_fp16_overflow_dit`` at ``H3_FP16_INT8_TINY_DIT`` as the official ``*_int8_convrot`` file holds it: every
    Linear whose input features ConvRot's groups divide int8 ConvRot (ComfyUI computes those through its
    mixed-precision ops)."""
    model = h3_dit_model(H3_FP16_INT8_TINY_DIT)
    quantized, _ = int8_convrot(model, h3_fp16_overflow_dit(H3_FP16_INT8_TINY_DIT), rotatable_linears(model))
    return quantized


def write_h3_fp16_models(models_dir: Path, loras: frozenset[str] = frozenset()) -> None:
    """The H3 models of ``write_models`` with ``h3_fp16_overflow_dit`` under the DiT file names, its Q8_0 GGUF
    (``H3_FP16_GGUF_FILE``) and its int8 ConvRot form (``H3_FP16_INT8_DIT_FILE``), and LoRAs without weights under
    ``loras`` (the official templates' names)."""
    generator = torch.Generator().manual_seed(SEED)
    save_model(models_dir, "text_encoders", H3_TEXT_ENCODER_FILE, h3_text_encoder(generator))
    save_model(models_dir, "vae", H3_VIDEO_VAE_FILE, h3_video_vae(generator))
    save_model(models_dir, "vae", H3_AUDIO_VAE_FILE, h3_audio_vae(generator))
    dit = h3_fp16_overflow_dit()
    for name in H3_DIT_FILES:
        save_model(models_dir, "diffusion_models", name, dit)
    h3_fp16_overflow_gguf(models_dir / "diffusion_models" / H3_FP16_GGUF_FILE, dit)
    save_model(models_dir, "diffusion_models", H3_FP16_INT8_DIT_FILE, h3_fp16_overflow_int8_dit())
    for name in loras:
        write_empty_lora(models_dir / "loras" / name)


def write_empty_lora(path: Path) -> None:
    """A LoRA without weights under a template's LoRA name: the templates' turbo LoRA sits behind a switch that is
    off, so ComfyUI only checks that the file exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({}, str(path))


def write_input_image(path: Path, side: int = 64) -> None:
    """A small random RGB picture (fixed seed) standing in for a template's input image."""
    from PIL import Image

    pixels = torch.randint(0, 256, (side, side, 3), generator=torch.Generator().manual_seed(SEED), dtype=torch.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.numpy()).save(path)



def save_gguf(state: dict, path: Path) -> None:
    """``state`` as a GGUF file with ComfyUI's tensor names (as ComfyUI-GGUF stores diffusion models and VAEs);
    bfloat16, which numpy lacks, as float32."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "minimax")
    for key, value in state.items():
        writer.add_tensor(key, (value.float() if value.dtype == torch.bfloat16 else value).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
