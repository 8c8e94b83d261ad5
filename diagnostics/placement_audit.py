"""Placement audit: where ComfyUI's loaders leave each MiniMax model's tensors, and what that costs per call.

For each model the running ComfyUI can build, the real class is built at its real configuration with FakeTensor
weights (shapes only: nothing full-size is allocated), loaded through ComfyUI's real ``ModelPatcher.load`` as the
legacy partial loader does at several VRAM budgets and through ``ModelPatcherDynamic`` (``placement_audit_dynamic``),
and run once with small inputs, compute on FakeTensor ``cuda:0``.
A dispatch mode watches every op of that call and records, per model and budget:

* ``cross-device``: an op given tensors on two devices (a crash on a GPU); the audit moves the stray operand and
  goes on, so one run finds them all;
* ``host build``: an op computing on the CPU from a model tensor the loader left there (or from such a result);
* ``host-to-device``: such a result copied to the compute device (bytes over the bus per call).

ComfyUI's own casts of offloaded weights (what lowvram means) are counted apart, not listed. Views are followed but
not counted. Where a model reads a value on the host (``float(sigma)``, ``.tolist()``, a boolean mask's positions), the
recorder answers from a real CPU shadow of that tensor, kept for small tensors computed only from the call's inputs
and constants (never from weights), so the control flow is the real one; a value that depends on weights stays
unknown and the model is listed as not audited. Each load is called twice and the second call is reported (per-call cost, not one-off copies such as a
fix's resident copy made on the first call). Each model runs twice:
pack off (stock) and pack on (the pack's fixes attached to the patcher as its loaders do). Models or load modes the
audit cannot run are listed as "not audited" with the reason.

Entry point: ``main(model_files, as_json)`` (``tools/doctor.py --audit``); ``audit()`` returns the rows. Needs
ComfyUI importable (``COMFYUI_PATH``); never imported by ComfyUI's start-up.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

COMPUTE = torch.device("cuda", 0)
OFFLOAD = torch.device("cpu")
BUDGETS = {"none": 0.0, "25%": 0.25, "50%": 0.5, "75%": 0.75, "full": 1.0}  # of the model's size, legacy loader
DYNAMIC = "dynamic"  # ModelPatcherDynamic (placement_audit_dynamic)
WHERE_SHOWN = 4  # places per table line (the JSON has them all)
COPY_OPS = ("aten._to_copy.default", "aten.copy_.default")
SHADOW_MAX_ELEMENTS = 1 << 16  # real shadows are kept for control tensors (timesteps, position ids, masks), not activations
UNINITIALISED = ("aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
                 "aten.new_empty.default", "aten.new_empty_strided.default")
INDEX_OPS = ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default", "aten._index_put_impl_.default")
# Findings the pack leaves on purpose: (model, tensor name pattern (fnmatch), kind) -> the measured cost and the reason.
ACCEPTED = {
    ("H3 video VAE decoder", "decoder.pos_embed.inv_freq", "host-to-device"):
        "32 bytes per decoder call (8 float32 values, stock `.to(img_ids.device)` in RotaryEmbeddingND); no crash, "
        "and smaller than one kernel launch's arguments. Cores with qk_norm_scale (0.36+) get a resident copy from "
        "vae_qk_norm_scale; on 0.33-0.35 no fix is attached for it",
    ("H3 video VAE decoder", "decoder.transformer_blocks.*.attn.qk_norm_scale", "host-to-device"):
        "9,216 bytes per decoder call (36 copies of 64 float32 values) on cores with upstream's call-site fix "
        "(`qk_norm_scale.to(query.device)`), where vae_qk_norm_scale reads 'fixed upstream' and attaches nothing; "
        "explicit copies, no crash, per VAE decode call (not per sampling step)",
    **{("H3 video VAE encoder", constant, "host-to-device"):
        "216 bytes per encode call in all (pixel_mean, pixel_std: 3 float32 values each, per 17-frame clip; "
        "latents_mean, latents_std: 24 each, once): stock `.to(x)` of the VAE's own normalisation constants, which a "
        "partial load leaves in CPU RAM; explicit copies, no crash, smaller than one kernel launch's arguments"
       for constant in ("pixel_mean", "pixel_std", "latents_mean", "latents_std")},
    ("H3 audio VAE", "*.filter", "host-to-device"):
        "254 copies, 1.76 MB in all, per decode: stock UpSample1d / LowPassFilter1d expand each 12-tap float32 "
        "anti-aliasing filter to the channel count and `cast_to_input` it; buffers of weight-less modules a partial "
        "load leaves in CPU RAM; explicit copies, no crash, once per VAE decode (not per sampling step)",
    **{("H3 audio VAE", constant, "host-to-device"):
        "128 bytes per encode or decode (24+24 float32 normalisation constants, stock `.to(device=z.device)`); "
        "explicit copies, no crash"
       for constant in ("latents_mean", "latents_std")},
    **{("H3 audio VAE", "pre_block.attn.q_bias", kind):
        "24,576 bytes per encode: stock CausalAttention concatenates q_bias, zero_k_bias and v_bias (2048 float32 "
        "each) on the host and casts the result; a partial load leaves them in CPU RAM (their module has children, so "
        "ModelPatcher does not list it as loadable); explicit copy, no crash, once per VAE encode"
       for kind in ("host build", "host-to-device")},
    ("H3 DiT", "diffusion_model.rope.inv_freq", "host-to-device"):
        "64 bytes per step (16 float32 values, stock `cast_to(self.rope.inv_freq, device)` in rope_freqs): a buffer of "
        "a weight-less module a partial load leaves in CPU RAM; explicit copy, no crash, smaller than one kernel "
        "launch's arguments",
    ("Music 3 DiT", "*_norm.beta", "host-to-device"):
        "4,096 bytes per offloaded LayerNorm per step (72 / 21 / 0 / 63 norms at budgets none / 25% / 50% / 75%, at "
        "most 295 kB per step): the "
        "LayerNorm's bias is a buffer, so stock `cast_to_input` copies it next to ComfyUI's own cast of the gamma "
        "weight beside it (same size); this is lowvram's weight streaming, no crash",
    ("Music 3 DiT", "*.rotary_pos_emb.inv_freq", "host-to-device"):
        "32 bytes per step (16 bf16 values, stock `cast_to_input` in RotaryEmbedding): a buffer of a weight-less "
        "module a partial load leaves in CPU RAM; explicit copy, no crash, smaller than one kernel launch's arguments",
}


@dataclass
class Finding:
    kind: str  # "cross-device", "host build", "host-to-device"
    module: str
    tensor: str
    op: str
    calls: int = 0
    bytes: int = 0
    accepted: str = ""  # why the pack leaves it, where it does


@dataclass
class Row:
    model: str
    budget: str
    pack: str  # "off" / "on"
    findings: list[Finding] = field(default_factory=list)
    weight_casts: int = 0
    weight_cast_bytes: int = 0
    not_audited: str = ""

    def count(self, kind: str) -> tuple[int, int]:
        found = [f for f in self.findings if f.kind == kind]
        return sum(f.calls for f in found), sum(f.bytes for f in found)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _is_cpu_scalar(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dim() == 0


class PlacementRecorder(TorchDispatchMode):
    """Runs every op (on FakeTensors where any operand or the target device is fake) and records placement faults."""

    def __init__(self, fake_mode, model: torch.nn.Module):
        super().__init__()
        self.fake_mode = fake_mode
        self.names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self.weights = {id(p) for p in model.parameters()}
        self.derived: dict[int, tuple[torch.Tensor, str]] = {}  # host results of offloaded model tensors -> origin
        self.findings: dict[tuple, Finding] = {}
        self.weight_casts = self.weight_cast_bytes = 0
        self.module_stack: list[str] = []
        self.shadows: dict[int, tuple[torch.Tensor, torch.Tensor, object]] = {}  # fake -> (fake, real value, storage)

    @contextlib.contextmanager
    def watching_modules(self, model: torch.nn.Module):
        paths = {id(m): n or type(m).__name__ for n, m in model.named_modules()}

        def enter(module, args):
            self.module_stack.append(paths.get(id(module), type(module).__name__))

        def leave(module, args, output):
            self.module_stack.pop()

        handles = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
                   torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _record(self, kind, tensor_name, func, nbytes):
        module = self.module_stack[-1] if self.module_stack else "<model>"
        key = (kind, module, tensor_name, str(func))
        finding = self.findings.setdefault(key, Finding(kind, module, tensor_name, str(func)))
        finding.calls += 1
        finding.bytes += nbytes

    def _origin(self, tensor) -> str | None:
        """The model tensor ``tensor`` is, or was computed on the host from; None for anything else."""
        if id(tensor) in self.names and tensor.device.type == "cpu":
            return self.names[id(tensor)]
        entry = self.derived.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def _real(self, value):
        """The real value of a tensor: itself when it is real, its shadow when it is fake (None: unknown)."""
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(value, FakeTensor):
            return value
        entry = self.shadows.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def _remember(self, fake_out, real_out):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.multiprocessing.reductions import StorageWeakRef

        for fake, real in zip(tree_leaves(fake_out), tree_leaves(real_out)):
            if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor):
                self.shadows[id(fake)] = (fake, real, StorageWeakRef(fake.untyped_storage()))

    def _forget(self, tensor):
        """``tensor`` was written with values the recorder does not know: every shadow of its storage is stale."""
        from torch.multiprocessing.reductions import StorageWeakRef

        storage = StorageWeakRef(tensor.untyped_storage())
        for key in [key for key, (_, _, other) in self.shadows.items() if other == storage]:
            del self.shadows[key]

    def _real_call(self, func, args, kwargs):
        """``func`` on the real values of its operands, on the CPU; None when an operand's value is unknown or large."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        operands = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if str(func) in UNINITIALISED or any(t.numel() > SHADOW_MAX_ELEMENTS for t in operands):
            return None
        real = [self._real(t) for t in operands]
        if any(r is None for r in real):
            return None
        values = iter(real)
        real_args, real_kwargs = tree_map(lambda v: next(values) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        if "device" in real_kwargs:
            real_kwargs["device"] = OFFLOAD
        with unset_fake_temporarily():
            return func(*real_args, **real_kwargs)

    def _mask_positions(self, func, args):
        """A boolean mask whose values are known, as the index tensors of its positions (the shape a fake mask
        cannot give)."""
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        if str(func) not in INDEX_OPS:
            return args
        indices = []
        for index in args[1]:
            real = self._real(index) if isinstance(index, FakeTensor) and index.dtype == torch.bool else None
            if real is None:
                indices.append(index)
                continue
            with unset_fake_temporarily():
                positions = real.nonzero(as_tuple=True)
            for position in positions:
                moved = FakeTensor(self.fake_mode, position.to("meta"), index.device)
                self._remember(moved, position)
                indices.append(moved)
        return (args[0], indices, *args[2:])

    def _call(self, func, args, kwargs, fake):
        from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, unset_fake_temporarily

        if not fake:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if str(func) == "aten._local_scalar_dense.default":  # float(t), t.item(), t.tolist()
            real = self._real(args[0])
            if real is not None:
                with unset_fake_temporarily():
                    return real.item()
        args = self._mask_positions(func, args)
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:  # unique, nonzero, ...: their output shape is known from the real values
            real_out = self._real_call(func, args, kwargs)
            if real_out is None:
                raise
            device = next(t.device for t in tree_leaves(args) if isinstance(t, torch.Tensor))
            out = tree_map(lambda r: FakeTensor(self.fake_mode, r.to("meta"), device)
                           if isinstance(r, torch.Tensor) else r, real_out)
            self._remember(out, real_out)
            return out
        real_out = self._real_call(func, args, kwargs)
        if real_out is not None:
            self._remember(out, real_out)
        else:
            for index, argument in enumerate(func._schema.arguments):
                value = args[index] if index < len(args) else kwargs.get(argument.name)
                if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, FakeTensor):
                    self._forget(value)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        target = kwargs.get("device")
        fake = any(isinstance(t, FakeTensor) for t in tensors) or (
            target is not None and torch.device(target).type == COMPUTE.type)
        origins = [o for o in map(self._origin, tensors) if o is not None]
        devices = {t.device for t in tensors if not _is_cpu_scalar(t)}
        is_copy = str(func) in COPY_OPS
        if len(devices) > 1 and not is_copy:
            stray = [t for t in tensors if t.device.type == "cpu" and not _is_cpu_scalar(t)]
            name = ", ".join(sorted({self._origin(t) or "activation" for t in stray}))
            self._record("cross-device", name, func, sum(map(_nbytes, stray)))

            def to_compute(value):
                if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not _is_cpu_scalar(value):
                    return value.to(COMPUTE)
                return value

            args, kwargs = tree_map(to_compute, (args, kwargs))
        out = self._call(func, args, kwargs, fake)
        if is_copy:
            source = args[1] if str(func) == COPY_OPS[1] else args[0]
            destination = args[0] if str(func) == COPY_OPS[1] else out
            if source.device.type == "cpu" and destination.device.type != "cpu":
                if id(source) in self.weights:
                    self.weight_casts += 1
                    self.weight_cast_bytes += _nbytes(source)
                elif origins:
                    self._record("host-to-device", origins[0], func, _nbytes(source))
                return out
            # a copy on the host (dynamic VRAM's cast of a weight for a CPU input) is host work like any other op
        if origins:
            results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
            for result in results:
                self.derived[id(result)] = (result, origins[0])
            if results and not func.is_view:
                self._record("host build", origins[0], func, sum(map(_nbytes, results)))
        return out


# -- models -----------------------------------------------------------------------------------------------------


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

    from torch._subclasses.fake_tensor import unset_fake_temporarily

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

    from torch._subclasses.fake_tensor import unset_fake_temporarily

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

    from torch._subclasses.fake_tensor import unset_fake_temporarily

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


# -- runs -------------------------------------------------------------------------------------------------------


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def _fake_cuda_runtime():
    """What ComfyUI asks the CUDA runtime and a fake ``cuda:0`` cannot answer: free memory (attention picks its kernel
    from it) and ``torch.cuda.synchronize`` (the loader syncs while moving modules)."""
    import comfy.model_management as mm

    stock, stock_synchronize = mm.get_free_memory, torch.cuda.synchronize

    def get_free_memory(dev=None, torch_free_too=False):
        if dev is not None and torch.device(dev).type == COMPUTE.type:
            return (64 << 30, 64 << 30) if torch_free_too else 64 << 30
        return stock(dev, torch_free_too)

    mm.get_free_memory, torch.cuda.synchronize = get_free_memory, lambda device=None: None
    try:
        yield
    finally:
        mm.get_free_memory, torch.cuda.synchronize = stock, stock_synchronize


def _move_by_assignment(module, *args, **kwargs):
    """``Module.to`` for FakeTensor weights, which torch can only swap in place (and refuses to while a weakref to
    them exists): each parameter and buffer is replaced by its moved copy."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    for owner in module.modules():
        for key, param in owner._parameters.items():
            if param is not None:
                moved = param.to(device=device, dtype=dtype if dtype is not None and param.is_floating_point() else None)
                owner._parameters[key] = torch.nn.Parameter(moved, requires_grad=param.requires_grad)
        for key, buffer in owner._buffers.items():
            if buffer is not None:
                owner._buffers[key] = buffer.to(device=device)
    return module


def _set_fake_data(tensor, new):
    """``param.data = moved`` (ModelPatcherDynamic's move of a weight beside child modules' weights): torch swaps the
    data of a FakeTensor but leaves its device as it was, so the device is set too."""
    torch._C.TensorBase.data.__set__(tensor, new)
    tensor.fake_device = new.device


@contextlib.contextmanager
def _fake_module_moves():
    from torch._subclasses.fake_tensor import FakeTensor

    stock = torch.nn.Module.to
    torch.nn.Module.to = _move_by_assignment
    FakeTensor.data = property(torch._C.TensorBase.data.__get__, _set_fake_data)
    try:
        yield
    finally:
        torch.nn.Module.to = stock
        del FakeTensor.data


def _legacy_load(model, budget: str):
    import comfy.model_patcher

    patcher = comfy.model_patcher.ModelPatcher(model, load_device=COMPUTE, offload_device=OFFLOAD)
    size = comfy.model_management.module_size(model)
    fraction = BUDGETS[budget]
    patcher.load(COMPUTE, lowvram_model_memory=max(1, int(size * fraction)) if fraction < 1 else 0,
                 full_load=fraction >= 1)
    return patcher


def run_one(spec: AuditedModel, budget: str, pack_on: bool, on_device: bool = False) -> Row:
    """Build ``spec``, load it with ``budget`` of its size through ComfyUI's ModelPatcher (``"dynamic"``: through
    ModelPatcherDynamic), optionally attach the pack's fixes, call it, and return what the recorder saw. On FakeTensor
    weights and a fake ``cuda:0``, or with ``on_device`` on the real GPU with the tensors ``spec.build`` gives."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from minimax_hotfix import registry

    from . import placement_audit_dynamic as dynamic

    row = Row(spec.name, budget, "on" if pack_on else "off")
    for fix in registry.fixes_for(spec.target):
        registry.status(fix)  # detection runs real tiny models: once, before any fake mode is active
    fake_mode = None if on_device else _fake_mode()
    tensors = fake_mode or contextlib.nullcontext()
    with contextlib.ExitStack() as runtime:
        if not on_device:
            runtime.enter_context(_fake_cuda_runtime())
        if budget == DYNAMIC and on_device:
            runtime.enter_context(dynamic.real_aimdo())  # ComfyUI's loaders build for it
        # moving to a fake cuda:0 must not touch the CUDA runtime
        with tensors, contextlib.nullcontext() if on_device else _fake_module_moves():
            model = spec.build()
            if budget == DYNAMIC and not on_device:  # after the build: aimdo's lazy layers wait for a state dict
                runtime.enter_context(dynamic.stand_ins())
            patcher = (dynamic.load(model, COMPUTE, OFFLOAD) if budget == DYNAMIC
                       else _legacy_load(model, budget))
            if pack_on:
                registry.attach_fixes(patcher, spec.target)
            patcher.inject_model()
        first = PlacementRecorder(fake_mode, model)  # includes one-off work (the fixes' resident copies)
        recorder = PlacementRecorder(fake_mode, model)
        try:
            for each in (first, recorder):
                with torch.no_grad(), each.watching_modules(model), tensors, each:
                    spec.call(model, fake_mode)
        except DataDependentOutputException as exc:
            row.not_audited = (f"the call reads the values of a tensor on the compute device ({exc.func}, e.g. "
                               "`.tolist()`), which a FakeTensor cannot give; needs a real device")
        finally:
            patcher.eject_model()
    row.findings = list(recorder.findings.values())
    for finding in row.findings:
        finding.accepted = next((why for (model, pattern, kind), why in ACCEPTED.items() if model == spec.name
                                 and kind == finding.kind and fnmatch.fnmatchcase(finding.tensor, pattern)), "")
        if spec.full_load_only and budget not in ("full", DYNAMIC):
            finding.accepted = f"unreachable: {spec.full_load_only}"
    row.weight_casts, row.weight_cast_bytes = recorder.weight_casts, recorder.weight_cast_bytes
    return row


def audit(budgets=None, budgets_by_model=None, audited=None, on_device=False) -> list[Row]:
    """Every model (``audited``: default every built-in configuration, plus those not audited) at every budget
    (``BUDGETS`` and dynamic VRAM by default; ``budgets_by_model`` names others for some models), pack off and on."""
    rows = []
    for spec in models() if audited is None else audited:
        if spec.build is None:
            rows.append(Row(spec.name, "-", "-", not_audited=spec.unavailable))
            continue
        for budget in (budgets_by_model or {}).get(spec.name, budgets or (*BUDGETS, DYNAMIC)):
            for pack_on in (False, True):
                rows.append(run_one(spec, budget, pack_on, on_device))
    return rows


def table(rows: list[Row]) -> str:
    """A Markdown table a user can paste into a bug report: one line per model, budget and pack state."""
    lines = ["| model | budget | pack | cross-device ops | host builds (bytes) | host-to-device (bytes) | "
             "weight casts (bytes) | where |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.not_audited:
            lines.append(f"| {row.model} | {row.budget} | {row.pack} | not audited: {row.not_audited} | | | | |")
            continue
        cross, _ = row.count("cross-device")
        builds, build_bytes = row.count("host build")
        copies, copy_bytes = row.count("host-to-device")
        places = sorted({f"{f.module}: {f.tensor}" + (" (accepted)" if f.accepted else "") for f in row.findings})
        where = "; ".join(places[:WHERE_SHOWN]) + (f"; +{len(places) - WHERE_SHOWN} more" if places[WHERE_SHOWN:]
                                                   else "")
        lines.append(f"| {row.model} | {row.budget} | {row.pack} | {cross} | {builds} ({build_bytes}) | "
                     f"{copies} ({copy_bytes}) | {row.weight_casts} ({row.weight_cast_bytes}) | {where or '-'} |")
    return "\n".join(lines)


def exit_code(rows: list[Row]) -> int:
    """1 when the pack leaves a finding it does not accept (``ACCEPTED``), else 0."""
    return 1 if [f for r in rows if r.pack == "on" for f in r.findings if not f.accepted] else 0


def main(model_files: list[str], as_json: bool) -> int:
    """``tools/doctor.py --audit [FILES...]``: print the audit of the built-in configurations, or of the models in
    ``model_files`` (``placement_audit_files``); exit 1 when the pack leaves a finding it does not accept, 2 when
    ComfyUI is not importable or a file cannot be audited."""
    from minimax_hotfix.registry.comfy import comfy_module

    from .comfyui_checkout import use_comfyui_checkout

    use_comfyui_checkout()
    if comfy_module("comfy.model_patcher") is None:
        print("placement audit: needs ComfyUI (set COMFYUI_PATH to a ComfyUI checkout and run with its Python)",
              file=sys.stderr)
        return 2
    if model_files:
        from . import placement_audit_files

        return placement_audit_files.main(model_files, as_json)
    rows = audit()
    print(json.dumps([asdict(r) for r in rows], indent=1) if as_json else table(rows))
    return exit_code(rows)
