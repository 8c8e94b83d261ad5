"""The placement audit's catalogue: each MiniMax model ComfyUI can build (real class, real configuration, as its
loaders build it) and how the sampler or the VAE nodes call it, with small inputs on the compute device. A model this
core lacks is listed with the reason. ComfyUI's modules are imported per model, after ``comfyui_checkout``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .placement_recorder import COMPUTE


@dataclass
class AuditedModel:
    """How to build one model (real class, real configuration) and call it with small inputs."""

    name: str
    target: str  # the pack's attach target: "clip", "vae", "model"
    build: object  # () -> nn.Module, called under the fake mode
    call: object  # (module, fake_mode) -> None
    unavailable: str = ""  # why this core cannot build it
    full_load_only: str = ""  # how ComfyUI's own loading never loads it partially (partial-load findings unreachable)


def _h3_vision_tower() -> AuditedModel:
    try:
        import comfy.ops
        from comfy.text_encoders.qwen3vl import QWEN3VL_VISION, QWEN3VL_VISION_COMMON, Qwen3VLVisionModel
    except ImportError as exc:
        return AuditedModel("H3 text encoder: Qwen3-VL vision tower", "clip", None, None, f"not in this core ({exc})")

    def build():
        config = {**QWEN3VL_VISION_COMMON, **QWEN3VL_VISION["qwen3vl_32b"], "out_hidden_size": 5120}
        holder = torch.nn.Module()  # the tower's place in the CLIP model
        holder.visual = Qwen3VLVisionModel(config, dtype=torch.bfloat16, ops=comfy.ops.manual_cast)
        return holder

    def call(holder, fake_mode):
        with unset_fake_temporarily():
            grid = torch.tensor([[1, 8, 8]])  # one 128x128 image: 64 patches, as ComfyUI passes it: on the CPU
        holder.visual(torch.empty(64, 3 * 2 * 16 * 16, device=COMPUTE), grid)

    return AuditedModel("H3 text encoder: Qwen3-VL vision tower", "clip", build, call)


def _h3_language_model() -> AuditedModel:
    name = "H3 text encoder: language model"
    try:
        from comfy.text_encoders.minimax import VISION_END, VISION_START, MiniMaxH3TEModel
    except ImportError as exc:
        return AuditedModel(name, "clip", None, None, f"not in this core ({exc})")

    def build():  # the CLIP model the H3 checkpoint loads: the 50-layer Qwen3-VL language model and its vision tower
        return MiniMaxH3TEModel(dtype=torch.bfloat16)

    def call(text_encoder, fake_mode):
        """What ``SDClipModel.forward`` does for "<Picture 1>: <128x128 image> a prompt": text embeddings from the
        model's own table, the tower's 16 merged tokens spliced in (the tower is audited on its own row), then one
        forward with the image's MRoPE position ids and DeepStack features."""
        clip = text_encoder.qwen3vl_32b
        with unset_fake_temporarily():
            grid = torch.tensor([[1, 8, 8]])  # as the tower's preprocessing returns it: on the CPU
        tokens = torch.tensor([[27, 20, 16, VISION_START, VISION_END, 64, 9934, 315]], device=COMPUTE)
        text = clip.transformer.get_input_embeddings()(tokens, out_dtype=torch.float32)
        vision = torch.empty(1, 16, text.shape[-1], device=COMPUTE)
        embeds = torch.cat([text[:, :4], vision, text[:, 4:]], dim=1)
        image = {"type": "image", "index": 4, "size": 16,
                 "extra": {"grid": grid, "deepstack": [torch.empty(16, text.shape[-1], device=COMPUTE)] * 3}}
        clip.transformer(None, None, embeds=embeds, num_tokens=[embeds.shape[1]], intermediate_output=None,
                         final_layer_norm_intermediate=False, dtype=torch.float32, embeds_info=[image])

    return AuditedModel(name, "clip", build, call)


def _music3_text_encoder() -> AuditedModel:
    name = "Music 3 text encoder (AR)"
    try:
        from comfy.ldm.minimax_music.ar import CFG_SCALE, CFG_TOP_K
        from comfy.text_encoders.minimax_music import MiniMaxMusic3TEModel
    except ImportError as exc:
        return AuditedModel(name, "clip", None, None, f"not in this core ({exc})")

    def build():  # bf16 (the class forces it), the pruned tables of the official file, picked by its own load_sd
        text_encoder = MiniMaxMusic3TEModel()
        text_encoder.load_sd({f"model.{table}.weight": getattr(text_encoder.model, table).weight
                              for table in ("embed_tokens_prefill", "lm_head_pruned")})
        return text_encoder

    def call(ar, fake_mode):
        """One frame of ``MiniMaxMusic3AR.generate``, call for call: the prefill of 6 prompt tokens (conditioned and
        unconditioned rows), the first code's sampling, the depth decoder's codes, and one single-token decode step.
        The loop itself (stop test on the sampled code, CUDA graphs) reads sampled values and is not run."""
        dtype = torch.bfloat16
        prompt = torch.tensor([[200000 - 10, 11, 12, 13, 14, 15]], device=COMPUTE)
        embeds = ar.model.embed_tokens_prefill(torch.cat((prompt, prompt)), out_dtype=dtype)
        past = ar.model.init_kv_cache(2, prompt.shape[1] + 2, COMPUTE, dtype)
        hidden, _, past = ar.model(None, embeds=embeds, past_key_values=past, dtype=dtype)
        last_hidden = hidden[:, -1]
        c0, _, _ = ar._sample_c0(last_hidden, CFG_SCALE, CFG_TOP_K, None, None)
        c0 = c0.repeat(2)
        codes, _ = ar._depth_codes(last_hidden, c0, ar._embed_c0(c0, dtype), None, dtype, CFG_SCALE, CFG_TOP_K)
        ar.model(None, embeds=ar._embed_audio_frame(codes, dtype), past_key_values=past, dtype=dtype)

    return AuditedModel(name, "clip", build, call)


def _h3_dit() -> AuditedModel:
    name = "H3 DiT"
    try:
        from comfy.supported_models import MiniMaxH3
    except ImportError as exc:
        return AuditedModel(name, "model", None, None, f"not in this core ({exc})")

    def build():  # as comfy.sd builds it for an H3 checkpoint (its detected configuration is the class defaults), bf16
        config = MiniMaxH3({"image_model": "minimax_h3"})
        config.set_inference_dtype(torch.bfloat16, None)
        return config.get_model({})

    def call(model, fake_mode):
        """The sampler's calls: ``extra_conds`` once per run (token refiner, packed layout), then one step through
        ``BaseModel.apply_model`` with the packed latent: one 2x2 video latent frame, two stereo audio frames, 8 text
        tokens. The step reads the sigma (``float``) and the text tags (``.tolist()``) on the host. Sizes are the
        model's own (a user's file may differ from the class defaults)."""
        dit = model.diffusion_model
        video, audio = dit.latents_dim, dit.audio_latents_dim
        shapes = [torch.Size((1, video, 1, 2, 2)), torch.Size((1, audio, 2, 2))]
        with unset_fake_temporarily():
            tags = torch.ones(8, dtype=torch.long)  # as the H3 text encoder returns them: on the CPU
        model.latent_shapes = shapes  # as the sampler sets it
        text = torch.empty(1, 8, dit.condition_proj.in_features, device=COMPUTE)
        conds = model.extra_conds(cross_attn=text, latent_shapes=shapes, device=COMPUTE, minimax_token_tags=tags)
        model.apply_model(torch.empty(1, 1, video * 4 + audio * 4, device=COMPUTE),
                          torch.full((1,), 0.5, device=COMPUTE), **{key: cond.cond for key, cond in conds.items()})

    return AuditedModel(name, "model", build, call)


def _h3_video_vae(part: str, call) -> AuditedModel:
    name = f"H3 video VAE {part}"
    try:
        from comfy.ldm.minimax.vae import MiniMaxH3VideoVAE
    except ImportError as exc:
        return AuditedModel(name, "vae", None, None, f"not in this core ({exc})")

    def build():
        return MiniMaxH3VideoVAE()  # comfy.sd.VAE's configuration for an H3 video VAE file (float32 here)

    return AuditedModel(name, "vae", build, call)


def _h3_video_vae_decoder() -> AuditedModel:
    def call(vae, fake_mode):
        vae.decoder(torch.empty(1, 24, 1, 2, 2, device=COMPUTE))  # one latent frame, 2x2

    return _h3_video_vae("decoder", call)


def _h3_video_vae_encoder() -> AuditedModel:
    def call(vae, fake_mode):
        vae.encode(torch.empty(1, 3, 1, 32, 32, device=COMPUTE))  # comfy.sd.VAE.encode's call: one 32x32 frame

    return _h3_video_vae("encoder", call)


def _h3_audio_vae() -> AuditedModel:
    name = "H3 audio VAE"
    try:
        from comfy.ldm.minimax.audio_vae import MiniMaxH3AudioVAE
    except ImportError as exc:
        return AuditedModel(name, "vae", None, None, f"not in this core ({exc})")

    def call(vae, fake_mode):  # comfy.sd.VAE's calls, float32: two stereo latent frames, then 1600 stereo samples
        vae.decode(torch.empty(1, 32, 2, 2, device=COMPUTE))
        vae.encode(torch.empty(1, 2, 1600, device=COMPUTE))

    return AuditedModel(name, "vae", MiniMaxH3AudioVAE, call)


def _music3_dit() -> AuditedModel:
    name = "Music 3 DiT"
    try:
        from comfy.supported_models import MiniMaxMusic3
    except ImportError as exc:
        return AuditedModel(name, "model", None, None, f"not in this core ({exc})")

    def build():  # as comfy.sd.load_diffusion_model_state_dict builds it: the BaseModel ModelPatcher holds, bf16
        config = MiniMaxMusic3({"audio_model": "minimax_music3"})
        config.set_inference_dtype(torch.bfloat16, None)
        return config.get_model({})

    def call(model, fake_mode):  # the sampler's call: 6 latent frames (2 condition frames), as the sampler passes them
        model.apply_model(torch.empty(1, 128, 6, device=COMPUTE), torch.full((1,), 0.5, device=COMPUTE),
                          c_crossattn=torch.empty(1, 2, 8 * 4096, device=COMPUTE),
                          conditioning_scale=torch.ones(1, 1, 1, device=COMPUTE))

    return AuditedModel(name, "model", build, call)


def _music3_dav() -> AuditedModel:
    name = "Music 3 DAV"
    try:
        import comfy.ops
        from comfy.ldm.minimax_music.dav import MiniMaxMusic3DAV
    except ImportError as exc:
        return AuditedModel(name, "vae", None, None, f"not in this core ({exc})")

    def build():
        return MiniMaxMusic3DAV(operations=comfy.ops.disable_weight_init)  # comfy.sd.VAE's, float32

    def call(dav, fake_mode):
        dav.decode(torch.empty(1, 128, 2, device=COMPUTE))  # two latent frames (1024 samples per channel)

    return AuditedModel(name, "vae", build, call, full_load_only=(
        "comfy.sd.VAE sets disable_offload for the DAV, so every decode calls load_models_gpu(force_full_load=True); "
        "a partial load (none in ComfyUI) would leave its weight-norm convolutions, which ModelPatcher does not list "
        "as loadable modules, on the offload device"))


def models() -> list[AuditedModel]:
    return [_h3_dit(), _h3_vision_tower(), _h3_language_model(), _h3_video_vae_decoder(), _h3_video_vae_encoder(),
            _h3_audio_vae(), _music3_text_encoder(), _music3_dit(), _music3_dav()]
