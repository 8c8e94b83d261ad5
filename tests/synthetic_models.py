"""Synthetic model files for running the bundled workflows on a real ComfyUI: random weights from a fixed seed, in
the official key layout and under the file names the workflows use, so that ComfyUI's own detection builds the
real model classes. Shapes come from ComfyUI's own modules (built on ``meta``), so they match the ComfyUI at hand.

ComfyUI hard-codes the size of MiniMax Music 3's text encoder (``comfy.text_encoders.minimax_music.MODEL_CONFIG``,
about 10 B parameters): the file is written for ``MUSIC3_TINY_TEXT_ENCODER`` instead, and the server that loads it
must apply the same numbers (``comfyui_probe`` does, from ``MUSIC3_TEXT_ENCODER_ENV``). The Music 3 DAV is written
at its real size (54 M parameters): ComfyUI reads nothing from its shapes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import save_file

SEED = 20260901
MUSIC3_TEXT_ENCODER_ENV = "MINIMAX_HOTFIX_TEST_MUSIC3_TEXT_ENCODER"
MUSIC3_TINY_TEXT_ENCODER = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "decoder_num_heads": 2, "decoder_intermediate_size": 64, "decoder_num_layers": 1,
}
MUSIC3_TEXT_ENCODER_FILE = "minimax_music3_text_encoder_pruned_int8_convrot.safetensors"
MUSIC3_DAV_FILE = "minimax_music3_dav.safetensors"
H3_DIT_FILES = ("minimax_h3_fl2va_pruned_int8_convrot.safetensors", "minimax_h3_ref2va_pruned_int8_convrot.safetensors")
# ComfyUI reads every one of these from the H3 DiT file's shapes; latents_dim and audio_latents_dim keep the real
# latent formats' channel counts
H3_TINY_DIT = {"hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 1, "num_attention_heads": 2,
               "attention_head_dim": 32, "ffn_hidden_size": 128, "latents_dim": 24, "audio_latents_dim": 32,
               "text_dim": 64, "timestep_input_dim": 256, "time_embed_hidden_size": 64, "time_embed_dim": 32,
               "rope_inv_freq_len": 16}


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
    from tokenizers import Tokenizer, models, pre_tokenizers

    from comfy.ldm.minimax_music.prompt import SPECIAL_TOKEN_IDS

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

    with mock.patch.dict(minimax_music.MODEL_CONFIG, MUSIC3_TINY_TEXT_ENCODER), torch.device("meta"):
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


def h3_dit(generator: torch.Generator) -> dict:
    import comfy.ops
    from comfy.ldm.minimax.model import MiniMaxH3Model

    with torch.device("meta"):
        model = MiniMaxH3Model(**H3_TINY_DIT, dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init)
    return random_state_dict(model, torch.bfloat16, generator)


def write_models(models_dir: Path) -> dict[str, Path]:
    """Writes every synthetic model under ``models_dir/<ComfyUI folder>/``; returns their paths by file name."""
    generator = torch.Generator().manual_seed(SEED)
    files = {("text_encoders", MUSIC3_TEXT_ENCODER_FILE): music3_text_encoder,
             ("vae", MUSIC3_DAV_FILE): music3_dav,
             **{("diffusion_models", name): h3_dit for name in H3_DIT_FILES}}
    written = {}
    for (folder, name), build in files.items():
        path = models_dir / folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(build(generator), str(path))
        written[name] = path
    return written


def music3_text_encoder_env() -> dict:
    return {MUSIC3_TEXT_ENCODER_ENV: json.dumps(MUSIC3_TINY_TEXT_ENCODER)}
