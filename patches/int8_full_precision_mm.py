"""int8_full_precision_mm: int8 models and VAEs on devices without ``torch._int_mm`` (Apple MPS) use dequantized weights.

Bug: an int8 checkpoint (``int8_tensorwise``, e.g. MiniMax H3's ``*_int8_convrot`` DiT and video VAE, or ``asym_w4a8_int8``) stops on a device whose torch has no int8 GEMM with ``NotImplementedError: The operator 'aten::_int_mm' is not currently implemented for the MPS device.``
ComfyUI 0.33.0 reaches ``torch._int_mm`` from ``Linear.forward`` itself (it has no dequantize step) and from the fused
``comfy.ops.linear_input_act`` (H3 DiT MLP ``fc2``, Llama/Qwen3 MLP ``down_proj``, Music 3 ``RVQMLP``). Cores with
#16130 dequantize in ``forward`` but only layers marked ``_full_precision_mm``, and ``linear_input_act`` ignores the
mark until #16285. Nothing marks the MiniMax H3 video VAE's layers (``comfy/sd.py`` builds it with
``mixed_precision_ops(quant_config, dtype)``) or the Music 3 text encoder's (``text_encoders/minimax_music.py``), so
those crash at VAE Decode / text encoding on every core seen, the fixed ones included.

Upstream: issue Comfy-Org/ComfyUI#16284; fixed for diffusion models and ``sd1_clip`` text encoders by PR #16130
(``supports_int8_compute``, dequantize in ``Linear.forward``) and PR #16285 (``linear_input_act`` honours
``_full_precision_mm``); no upstream fix for the VAE or the Music 3 text encoder yet. Follow-ups: #16458 (MPS has
``_int_mm`` since torch 2.15 but ComfyUI still switches native int8 off there), comfy-kitchen PR #107.

Applies to: ComfyUI 0.33.0 and later with comfy-kitchen's int8 layouts; any torch.

Detection ("fixed upstream"), per kind of model (``MODEL_KINDS``): behavioural. For each kind a tiny int8 Linear is
built with the ``mixed_precision_ops`` options that kind's loader passes on a device without int8 compute, loaded from
a state dict the way ComfyUI loads quantized checkpoints, and run through ``forward`` and ``linear_input_act`` on CPU;
a kind whose two results equal a linear with the dequantized weight (within fp32 rounding, far below int8 activation
rounding) is fixed upstream. The fix is "fixed upstream" only when every kind is; the reason lists each kind. At
attach time the same question is asked of each real layer: a layer the core dequantizes itself (marked
``_full_precision_mm`` on a core that honours the mark) is left alone, and a model with no other int8 layer gets
nothing attached. A ``linear_input_act`` signature with parameters this fix does not know disables it (target drifted).
Delete this file once ComfyUI dequantizes every kind's int8 layers on devices without int8 compute.

Off switch: ``MINIMAX_HOTFIX_DISABLE=int8_full_precision_mm``.

How: attached to MODEL, CLIP and VAE patchers as an injection. When the patcher's load device fails a real
``torch._int_mm`` probe (kernels/int8_fallback.py; cached per device, so MPS on torch >= 2.15 keeps native int8),
every int8-GEMM Linear of that model that the core does not dequantize itself gets an instance ``forward`` that
computes with the weight dequantized once and cached until ComfyUI moves or patches it, and is marked for
``linear_input_act``. Each call checks the input's device again, so where int8 compute exists the layer's own fused
kernel runs. ``linear_input_act`` is a free function that model code looks up in ``comfy.ops`` on every call, not an
attribute of anything a patcher owns, so no object patch, injection or sampling wrapper (those do not reach CLIP) can
redirect it per model: the fix installs, once and only when a model needs it, a wrapper of
``comfy.ops.linear_input_act`` that diverts the layers marked here and passes every other call to the original
unchanged. Ejecting the model (unload, partial unload, detach) removes the marks, the instance forwards and the cached
weights.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import json
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.int8_fallback import DequantizedLinear, dequantizer, forget_int8_probes, int8_compute_available
from ._comfy import comfy_module
from ._devices import real_accelerator
from ._fix import AttributeOverride, Check, Fix, State, Status, model_injection, set_injection

log = logging.getLogger("minimax_hotfix")
_honours_full_precision_mm: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

FIX_ID = "int8_full_precision_mm"
# Layouts whose comfy-kitchen kernels multiply with torch._int_mm (ConvRot W4A4 multiplies in floating point).
INT8_GEMM_LAYOUTS = frozenset({"TensorWiseINT8Layout", "AsymW4A8Int8Layout"})
# linear_input_act's parameters as they grew (0.33.0 has the first three); the fallback takes them in this order.
LINEAR_INPUT_ACT_PARAMETERS = ("linear", "x", "input_act", "act_weight", "act_eps", "residual", "residual_scale")
# Set on each diverted layer (its fallback object) and on the linear_input_act wrapper (the wrapper itself, so it is
# still found under a wrapper another pack puts on top with functools.wraps, which copies the attribute).
MARK = "_minimax_hotfix_int8_fallback"
MPS_INT_MM_ERROR = "The operator 'aten::_int_mm' is not currently implemented for the MPS device."
# Quant formats whose comfy-kitchen kernels need int8 compute: cores with #16130 disable them per load device.
INT8_COMPUTE_FORMATS = frozenset({"int8_tensorwise", "asym_w4a8_int8", "convrot_w4a4"})


@dataclass(frozen=True)
class ModelKind:
    """One way ComfyUI builds int8 layers: ``options(model_management)`` are the ``mixed_precision_ops`` options its
    loader passes for a load device without int8 compute; ``built_by`` says where and how, for the status reason."""

    name: str
    target: str
    built_by: str
    options: object


def _diffusion_model_options(model_management) -> dict:
    """``pick_operations`` on cores with #16130 disables the int8 formats where ``supports_int8_compute`` says no (the
    query decides by device type: MPS is the device it answers no for on every such core), which marks the layers
    ``_full_precision_mm``; older cores disable no int8 format."""
    query = getattr(model_management, "supports_int8_compute", None)
    lacking = query is not None and not query(torch.device("mps"))
    return {"disabled": sorted(INT8_COMPUTE_FORMATS) if lacking else []}


# Every loader of ComfyUI that builds int8 layers (docs/int8_fallback.md has the table, with the loaders that cannot).
MODEL_KINDS = (
    ModelKind("diffusion model", "model", "comfy.ops.pick_operations(..., model_config=<quantized>) in model_base",
              _diffusion_model_options),
    ModelKind("text encoder", "clip", "comfy/sd1_clip.py: mixed_precision_ops(quant_config, dtype, "
              "full_precision_mm=True)", lambda model_management: {"full_precision_mm": True}),
    ModelKind("Music 3 text encoder", "clip", "comfy/text_encoders/minimax_music.py: mixed_precision_ops(quant_config, "
              "dtype), no full_precision_mm", lambda model_management: {}),
    ModelKind("MiniMax H3 video VAE", "vae", "comfy/sd.py: mixed_precision_ops(quant_config, dtype), no "
              "full_precision_mm, no disabled formats", lambda model_management: {}),
)


class DequantizedInt8Linear(DequantizedLinear):
    """One ComfyUI int8 layer computed as ``F.linear(x, dequantized weight, bias)`` where ``x``'s device has no int8
    GEMM, in ``forward`` and in ``linear_input_act``."""

    def __init__(self, layer, ops, may_keep):
        self.ops = ops
        super().__init__(layer, dequantizer(ops.QuantizedTensor), may_keep)

    def linear_input_act(self, x, input_act, act_weight=None, act_eps=0.0, residual=None, residual_scale=None):
        """``linear_input_act`` with its activation applied eagerly, as the core's own non-int8 path does."""
        out = self.linear(self._activate(x, input_act, act_weight, act_eps))
        if residual is None:
            return out
        return residual + out if residual_scale is None else torch.addcmul(residual, out, residual_scale)

    def linear(self, x):
        self.ops.run_every_op()  # the stock forward's interrupt check
        layer = self.layer
        weight, bias = layer.weight, layer.bias
        if (layer.weight_function or layer.bias_function or weight.device != x.device
                or (bias is not None and bias.device != x.device)):
            return self._linear_cast_per_call(x)
        return self.dequantized_linear(x, weight, bias)

    def _linear_cast_per_call(self, x):
        """An offloaded weight is streamed in and an on-the-fly LoRA applied by ComfyUI's cast on every call, so there
        is no resident weight to cache; keeping a dequantized copy on the compute device would also undo the offload."""
        weight, bias, offload_stream = self.ops.cast_bias_weight(self.layer, x, offloadable=True)
        try:
            return F.linear(x, self.dequantize(weight, x.dtype), bias)
        finally:
            self.ops.uncast_bias_weight(self.layer, weight, bias, offload_stream)

    def _activate(self, x, input_act, act_weight, act_eps):
        if input_act in (None, "none"):
            return x
        if input_act == "rms_norm":
            return comfy_module("comfy.rmsnorm").rms_norm(x, act_weight, act_eps)
        return self.ops.INPUT_ACT_EAGER[input_act](x)


def diverting_linear_input_act(stock):
    """``stock`` for every layer except those a fixed model marked, and for those too where int8 compute exists."""

    @functools.wraps(stock)
    def linear_input_act(linear, x, input_act, *args, **kwargs):
        fallback = linear.__dict__.get(MARK)
        if fallback is None or int8_compute_available(x.device):
            return stock(linear, x, input_act, *args, **kwargs)
        return fallback.linear_input_act(x, input_act, *args, **kwargs)

    setattr(linear_input_act, MARK, linear_input_act)
    return linear_input_act


def has_int8_gemm_weight(module, quantized_tensor) -> bool:
    """A Linear-shaped layer (not an Embedding, not an expert bank) whose weight comfy-kitchen multiplies in int8."""
    weight = module._parameters.get("weight")
    return (isinstance(weight, quantized_tensor) and weight._layout_cls in INT8_GEMM_LAYOUTS and weight.dim() == 2
            and hasattr(module, "in_features") and not hasattr(module, "num_experts"))


def memory_guard(model_management, fix_id: str):
    """Cache a dequantized weight only while ComfyUI's own inference reserve stays free on its device: int8 is
    often chosen because memory is tight, and a full cache of a large DiT would not fit next to it."""
    told = False

    def may_keep(nbytes: int, device) -> bool:
        nonlocal told
        fits = model_management.get_free_memory(device) - nbytes >= model_management.minimum_inference_memory()
        if not fits and not told:
            told = True
            log.info("MiniMax Hotfix: %s: %s is nearly full; further int8 layers dequantize on every call instead "
                     "of caching their weights", fix_id, device)
        return fits

    return may_keep


def tiny_int8_linear(ops, in_features: int, out_features: int, device="cpu", **options):
    """A bias-free ``int8_tensorwise`` Linear of the running core built with ``mixed_precision_ops(..., **options)``,
    loaded from a state dict as checkpoints are."""
    generator = torch.Generator().manual_seed(0)
    quantized = ops.QuantizedTensor.from_float(
        torch.randn(out_features, in_features, generator=generator), "TensorWiseINT8Layout")
    layer = ops.mixed_precision_ops({}, torch.float32, **options).Linear(
        in_features, out_features, bias=False, device=device)
    config = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    layer.load_state_dict({"weight": quantized._qdata, "weight_scale": quantized._params.scale,
                           "comfy_quant": config}, strict=False)
    if not isinstance(layer.weight, ops.QuantizedTensor):
        raise RuntimeError("an int8_tensorwise state dict no longer loads as a QuantizedTensor weight")
    return layer


def matches(result: torch.Tensor, reference: torch.Tensor) -> bool:
    """Equal within fp32 rounding; int8 activation rounding is ~1e-3 of the output scale, 100x above this."""
    return bool((result - reference).abs().max() <= 1e-5 * reference.abs().max())


class Int8FullPrecisionMM(Fix):
    id = FIX_ID
    title = "int8 models and VAEs on devices without torch._int_mm (Apple MPS): forward and linear_input_act dequantize"
    targets = ("model", "clip", "vae")
    upstream = "Comfy-Org/ComfyUI#16284 (fixed by #16130 and #16285)"

    def detect(self) -> Status:
        ops = comfy_module("comfy.ops")
        if ops is None or not hasattr(ops, "mixed_precision_ops") or not hasattr(ops, "linear_input_act"):
            return Status(State.NOT_APPLICABLE, "no ComfyUI with int8 ops and linear_input_act is importable here")
        drift = self._drift(ops)
        if drift:
            return Status(State.FAILED, f"target drifted: {drift}")
        reaching = self.kinds_reaching_int_mm(ops)
        parts = []
        for kind in MODEL_KINDS:
            paths = " and ".join(reaching[kind.name])
            verdict = (f"needs it: does not dequantize in {paths}" if paths
                       else "fixed upstream: dequantizes in Linear.forward and linear_input_act")
            parts.append(f"{kind.name} ({kind.target}) {verdict} ({kind.built_by})")
        if not any(reaching.values()):
            return Status(State.FIXED_UPSTREAM, "; ".join(parts))
        return Status(State.APPLIED, "; ".join(parts) + ". Diverted to a dequantized weight on devices where the op "
                                                        "is missing, for the kinds that need it")

    def kinds_reaching_int_mm(self, ops) -> dict[str, list[str]]:
        """For each model kind, the call paths on which a layer built as that kind's loader builds it for a device
        without int8 compute does not compute with its dequantized weight: it shows int8 activation rounding, or
        raises (from a missing ``_int_mm``, or from an int8 kernel that does not take the core's arguments); either
        way the fallback, which needs neither, is what computes right there."""
        model_management = comfy_module("comfy.model_management")
        reaching = {}
        with torch.no_grad():
            for kind in MODEL_KINDS:
                (forward, fused), reference, _ = self._probe(ops, torch.device("cpu"),
                                                             **kind.options(model_management))
                outcomes = {"Linear.forward": _outcome(forward, Exception), "linear_input_act": _outcome(fused, Exception)}
                reaching[kind.name] = [path for path, out in outcomes.items()
                                       if not (isinstance(out, torch.Tensor) and matches(out, reference))]
        return reaching

    @staticmethod
    def _drift(ops) -> str:
        parameters = tuple(inspect.signature(ops.linear_input_act).parameters)
        if len(parameters) < 3 or parameters != LINEAR_INPUT_ACT_PARAMETERS[:len(parameters)]:
            return f"comfy.ops.linear_input_act{inspect.signature(ops.linear_input_act)} has unknown parameters"
        needed = {"comfy.ops": ("QuantizedTensor", "INPUT_ACT_EAGER", "cast_bias_weight", "uncast_bias_weight",
                                "run_every_op"),
                  "comfy.model_management": ("get_free_memory", "minimum_inference_memory")}
        if "act_weight" in parameters:
            needed["comfy.rmsnorm"] = ("rms_norm",)
        for module_name, names in needed.items():
            module = comfy_module(module_name)
            missing = [name for name in names if not hasattr(module, name)]
            if missing:
                return f"{module_name} has no {', '.join(missing)}"
        if "swiglu" not in ops.INPUT_ACT_EAGER:
            return "comfy.ops.INPUT_ACT_EAGER has no swiglu"
        return ""

    def attach(self, patcher, key: str) -> None:
        """Nothing is attached to a model whose int8 layers the core dequantizes itself (a kind fixed upstream)."""
        ops = comfy_module("comfy.ops")
        if any(self.needs_diversion(module, ops) for module in patcher.model.modules()):
            set_injection(patcher, key, self.injection())

    def needs_diversion(self, module, ops) -> bool:
        """An int8-GEMM layer that the running core would hand to ``torch._int_mm`` on a device without it: any such
        layer unless it is marked ``_full_precision_mm`` and the core honours the mark on both call paths."""
        if not has_int8_gemm_weight(module, ops.QuantizedTensor):
            return False
        return not (getattr(module, "_full_precision_mm", False) and self.honours_full_precision_mm(ops))

    def honours_full_precision_mm(self, ops) -> bool:
        """Whether ``ops`` dequantizes ``_full_precision_mm`` int8 layers in forward and linear_input_act (probed once
        per ``comfy.ops`` module)."""
        known = _honours_full_precision_mm.get(ops)
        if known is None:
            with torch.no_grad():
                paths, reference, _ = self._probe(ops, torch.device("cpu"), full_precision_mm=True)
                known = all(isinstance(out, torch.Tensor) and matches(out, reference)
                            for out in (_outcome(path, Exception) for path in paths))
            _honours_full_precision_mm[ops] = known
        return known

    def injection(self):
        """Diverts the model's int8 layers after each load, but only when its load device lacks int8 compute, so a
        model on a CUDA device is left exactly as the stock loader made it."""
        divert = model_injection(self.divert_int8_layers, self.id)

        def inject(patcher) -> None:
            if not int8_compute_available(patcher.load_device):
                divert.inject(patcher)
            else:
                log.info("MiniMax Hotfix: %s hooked 0 module(s) of %s: %s has int8 compute", self.id,
                         type(patcher.model).__name__, patcher.load_device)

        return type(divert)(inject=inject, eject=divert.eject)

    def divert_int8_layers(self, model) -> list:
        ops = comfy_module("comfy.ops")
        layers = [module for module in model.modules() if self.needs_diversion(module, ops)]
        if not layers:
            return []
        self.install()
        may_keep = memory_guard(comfy_module("comfy.model_management"), self.id)
        handles = []
        for layer in layers:
            fallback = DequantizedInt8Linear(layer, ops, may_keep)
            handles += [AttributeOverride(layer, "forward", fallback.forward), AttributeOverride(layer, MARK, fallback)]
        log.info("MiniMax Hotfix: %s: %d int8 layers compute with dequantized weights where torch._int_mm is missing",
                 self.id, len(layers))
        return handles

    def install(self) -> None:
        """Wrap ``comfy.ops.linear_input_act`` once (see the banner for why no per-model hook can)."""
        ops = comfy_module("comfy.ops")
        if getattr(ops.linear_input_act, MARK, None) is None:
            ops.linear_input_act = diverting_linear_input_act(ops.linear_input_act)

    def uninstall(self) -> None:
        """Put the original back, unless another pack has wrapped ours since (removing ours would drop theirs; ours
        passes every unmarked layer straight through)."""
        ops = comfy_module("comfy.ops")
        ours = getattr(getattr(ops, "linear_input_act", None), MARK, None)
        if ours is not None and ops.linear_input_act is ours:
            ops.linear_input_act = ours.__wrapped__

    def self_test(self):
        """Red: a stock int8 layer reaches torch._int_mm where it is missing (the accelerator if it lacks the op, else
        CPU with the op simulated away: comfy-kitchen's CPU backend calls torch._int_mm, its CUDA one does not).
        Green: the fix matches a linear with the dequantized weight; where int8 compute exists the fused kernel runs.
        Without ComfyUI the same checks run on comfy-kitchen's int8 linear itself, diverted by the pack's kernel."""
        ops = comfy_module("comfy.ops")
        if ops is None:
            if importlib.util.find_spec("comfy_kitchen") is not None:
                yield from red_green_checks(kernel_probe, "comfy-kitchen's int8 F.linear", "the int8 layer computes")
            return
        state = self.detect().state
        if state not in (State.APPLIED, State.FIXED_UPSTREAM):
            yield Check(f"not run: {state.value}", passed=state is State.NOT_APPLICABLE)
            return
        yield from red_green_checks(functools.partial(self._probe, ops),
                                    "a stock int8 layer in forward and linear_input_act", "both paths compute",
                                    fixed_upstream=state is State.FIXED_UPSTREAM)

    def _probe(self, ops, device, **options):
        """An int8 layer of the running core on ``device``, built with ``mixed_precision_ops(..., **options)``: its two
        call paths (forward, linear_input_act with swiglu), their fp32 reference with the dequantized weight, and the
        layer diverted as the fix diverts it."""
        layer = tiny_int8_linear(ops, 64, 16, device=device, **options)
        gated = torch.randn(8, 128, generator=torch.Generator().manual_seed(1)).to(device)
        activated = ops.INPUT_ACT_EAGER["swiglu"](gated)
        paths = (lambda: layer(activated), lambda: ops.linear_input_act(layer, gated, "swiglu"))
        return paths, F.linear(activated, layer.weight.dequantize()), functools.partial(self._diverted, layer)

    @contextlib.contextmanager
    def _diverted(self, layer):
        """``layer`` diverted as an injected model's would be; the wrapper is removed again if it was not there."""
        ops = comfy_module("comfy.ops")
        was_installed = getattr(ops.linear_input_act, MARK, None) is not None
        handles = self.divert_int8_layers(torch.nn.ModuleList([layer]))
        try:
            yield
        finally:
            for handle in reversed(handles):
                handle.remove()
            if not was_installed:
                self.uninstall()


def red_green_checks(probe, stock_name: str, fixed_name: str, fixed_upstream=False):
    """The self-test steps for ``probe(device, full_precision_mm) -> (paths, reference, diverted)``: the call paths
    of one int8 layer on ``device``, their fp32 reference with the dequantized weight, and a context manager under
    which the layer is diverted as the fix diverts it."""
    accelerator = real_accelerator()
    native = accelerator if accelerator is not None and int8_compute_available(accelerator) else None
    lacking = accelerator if accelerator is not None and native is None else torch.device("cpu")
    with torch.no_grad(), int8_gemm_missing(lacking) as how:
        paths, reference, diverted = probe(lacking, full_precision_mm=fixed_upstream)
        stock = [_outcome(path) for path in paths]
        if fixed_upstream:
            yield Check(f"fixed upstream: both paths run without torch._int_mm ({how})",
                        passed=all(isinstance(out, torch.Tensor) and matches(out, reference) for out in stock))
            return
        yield Check(f"red: {stock_name} reaches torch._int_mm ({how})",
                    passed=all(isinstance(out, Exception) and "_int_mm" in str(out) for out in stock),
                    detail=" / ".join(str(out).splitlines()[0] if isinstance(out, Exception) else "no error"
                                      for out in stock))
        with diverted():
            fixed = [path() for path in paths]
        yield Check(f"green: with the fix {fixed_name} with the dequantized weight",
                    passed=all(matches(out, reference) for out in fixed),
                    detail=f"max abs diff {max((out - reference).abs().max().item() for out in fixed):.1e}")
    native = native or (torch.device("cpu") if int8_compute_available("cpu") else None)
    if native is None:
        return
    with torch.no_grad():
        paths, reference, diverted = probe(native, full_precision_mm=False)
        stock = [path() for path in paths]
        with diverted():
            kept = [path() for path in paths]
    # the fused kernel's int8 activation rounding is what sets its result apart from the dequantized reference
    yield Check(f"green: where {native} has torch._int_mm the fused int8 kernel still runs",
                passed=all(torch.equal(out, ref) and not matches(out, reference) for out, ref in zip(kept, stock)))


def kernel_probe(device, full_precision_mm: bool):
    """Without ComfyUI: a torch Linear holding a comfy-kitchen int8 weight (``F.linear`` dispatches it to
    comfy-kitchen's ``int8_linear``), diverted by the pack's ``DequantizedLinear``. ``full_precision_mm`` is a core
    setting: there is no core here to honour it."""
    from comfy_kitchen.tensor import QuantizedTensor

    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).to(device)
    layer = torch.nn.Linear(64, 16, bias=False, device="meta")  # its weight is replaced: nothing to draw
    layer.weight = torch.nn.Parameter(QuantizedTensor.from_float(weight, "TensorWiseINT8Layout"), requires_grad=False)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(device)

    @contextlib.contextmanager
    def diverted():
        fallback = DequantizedLinear(layer, dequantizer(QuantizedTensor), may_keep=lambda nbytes, device: True)
        override = AttributeOverride(layer, "forward", fallback.forward)
        try:
            yield
        finally:
            override.remove()

    return (lambda: layer(x),), F.linear(x, layer.weight.dequantize()), diverted


def _outcome(call, raised=(NotImplementedError, RuntimeError)):
    try:
        return call()
    except raised as exc:
        return exc


@contextlib.contextmanager
def int8_gemm_missing(device):
    """The device as one without int8 compute: the real thing where ``torch._int_mm`` is missing, otherwise the op
    swapped for one raising the MPS error for the duration (only the doctor, a process of its own, runs this)."""
    if not int8_compute_available(device):
        yield f"{device} has no torch._int_mm"
        return
    real = torch._int_mm

    def missing(*args, **kwargs):
        raise NotImplementedError(MPS_INT_MM_ERROR)

    torch._int_mm = missing
    forget_int8_probes()
    try:
        yield f"simulated on {device}: torch._int_mm raises the MPS error"
    finally:
        torch._int_mm = real
        forget_int8_probes()


FIX = Int8FullPrecisionMM()
