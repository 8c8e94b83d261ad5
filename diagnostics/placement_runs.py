"""The placement audit's runs and report: each catalogue model loaded through ComfyUI's real ``ModelPatcher`` at each
VRAM budget (and ``ModelPatcherDynamic``), pack off and on, called under the recorder; the rows, the findings the
pack leaves on purpose (``ACCEPTED``), the Markdown table and the exit code."""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor

from .. import registry
from . import placement_audit_dynamic as dynamic
from .placement_models import AuditedModel, models
from .placement_recorder import COMPUTE, OFFLOAD, Finding, PlacementRecorder
from .placement_recorder import fake_mode as new_fake_mode
from .progress import progress

BUDGETS = {"none": 0.0, "25%": 0.25, "50%": 0.5, "75%": 0.75, "full": 1.0}  # of the model's size, legacy loader
DYNAMIC = "dynamic"  # ModelPatcherDynamic (placement_audit_dynamic)
WHERE_SHOWN = 4  # places per table line (the JSON has them all)

# Findings the pack leaves on purpose: (model, tensor name pattern (fnmatch), kind) -> the measured cost and the reason.
# tests/test_placement_audit.py checks that each entry matches a finding the audit measures (SHOWS_WHERE: where).
ACCEPTED = {
    ("H3 video VAE decoder", "decoder.pos_embed.inv_freq", "host-to-device"):
        "32 bytes per decoder call (8 float32 values, stock `.to(img_ids.device)` in RotaryEmbeddingND); no crash, "
        "and smaller than one kernel launch's arguments. Cores with qk_norm_scale (0.36+) get a resident copy from "
        "vae_qk_norm_scale; on 0.33-0.35 no fix is attached for it",
    ("H3 video VAE decoder", "decoder.transformer_blocks.*.attn.qk_norm_scale", "host-to-device"):
        "9,216 bytes per decoder call (36 copies of 64 float32 values) on cores with upstream's call-site fix "
        "(`qk_norm_scale.to(query.device)`), where vae_qk_norm_scale reads 'fixed upstream' and attaches nothing; "
        "explicit copies, no crash, per VAE decode call (not per sampling step)",
    ("H3 video VAE decoder", "decoder.transformer_blocks.*.norm[12].weight", "host-to-device"):
        "589,824 bytes per decoder call (36 blocks x 2 RMSNorm weights of 2048 float32 values): 0.33.0's "
        "transformer block hands its norms' weights to comfy.rmsnorm.rms_norm itself, which copies them to the "
        "input; the same bytes ComfyUI's own cast of those norms would move, explicit copies, no crash, per VAE "
        "decode call (not per sampling step)",
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
    ("H3 DiT", "diffusion_model.blocks.*.attn.[qk]_norm.weight", "host-to-device"):
        "25,600 bytes per step (50 blocks x 2 RMSNorm weights of 128 bf16 values): stock attention copies the q/k "
        "norm weights with `cast_to(..., device=x.device)` for the fused rms_rope on every call (0.33.0 and the "
        "0.39 era alike), where a partial load leaves them in CPU RAM; the same bytes ComfyUI's own cast of those "
        "norms would move, explicit copies, no crash",
    ("Music 3 DiT", "*_norm.beta", "host-to-device"):
        "4,096 bytes per offloaded LayerNorm per step (72 / 21 / 0 / 63 norms at budgets none / 25% / 50% / 75%, at "
        "most 295 kB per step): the "
        "LayerNorm's bias is a buffer, so stock `cast_to_input` copies it next to ComfyUI's own cast of the gamma "
        "weight beside it (same size); this is lowvram's weight streaming, no crash",
    ("Music 3 DiT", "*.rotary_pos_emb.inv_freq", "host-to-device"):
        "32 bytes per step (16 bf16 values, stock `cast_to_input` in RotaryEmbedding): a buffer of a weight-less "
        "module a partial load leaves in CPU RAM; explicit copy, no crash, smaller than one kernel launch's arguments",
}


# the entries whose finding exists only where a fix reads a state: (fix id, state)
def _decoder_hands_its_norm_weights_to_rms_norm() -> bool:
    """0.33.0's transformer block (and a core whose ``linear_input_act`` computes the rms_norm input eagerly) copies
    the norms' weights itself; 0.39's ``linear_input_act`` reads them through ComfyUI's own weight cast."""
    import inspect

    import comfy.ldm.minimax.vae
    import comfy.ops

    return ("rms_norm(x, self.norm1.weight" in inspect.getsource(comfy.ldm.minimax.vae)
            or "rms_norm(x, act_weight" in inspect.getsource(comfy.ops.linear_input_act))


# Entries that show only on some cores: key -> ("fix id", "state") where the finding shows only while that fix reads
# that state, or a function of the running core's code.
SHOWS_WHERE = {("H3 video VAE decoder", "decoder.transformer_blocks.*.attn.qk_norm_scale", "host-to-device"):
               ("vae_qk_norm_scale", "fixed upstream"),
               ("H3 video VAE decoder", "decoder.transformer_blocks.*.norm[12].weight", "host-to-device"):
               _decoder_hands_its_norm_weights_to_rms_norm}


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
    row = Row(spec.name, budget, "on" if pack_on else "off")
    for fix in registry.fixes_for(spec.target):
        registry.status(fix)  # detection runs real tiny models: once, before any fake mode is active
    fake_mode = None if on_device else new_fake_mode()
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


def audit(budgets=None, budgets_by_model=None, audited=None, on_device=False, show_progress=False) -> list[Row]:
    """Every model (``audited``: default every built-in configuration, plus those not audited) at every budget
    (``BUDGETS`` and dynamic VRAM by default; ``budgets_by_model`` names others for some models), pack off and on;
    with ``show_progress``, each run (model x budget x pack, done/total, elapsed) on stderr as it goes."""
    runs = [(spec, budget, pack_on) for spec in (models() if audited is None else audited)
            for budget, pack_on in ([("-", None)] if spec.build is None else
                                    [(budget, pack_on)
                                     for budget in (budgets_by_model or {}).get(spec.name, budgets or (*BUDGETS, DYNAMIC))
                                     for pack_on in (False, True)])]
    if show_progress:
        runs = progress(runs, "placement audit", lambda run: f"{run[0].name} x {run[1]} x pack "
                                                             f"{'-' if run[2] is None else 'on' if run[2] else 'off'}")
    return [Row(spec.name, "-", "-", not_audited=spec.unavailable) if pack_on is None
            else run_one(spec, budget, pack_on, on_device) for spec, budget, pack_on in runs]


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
