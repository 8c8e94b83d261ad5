"""int8_full_precision_mm: int8 models and VAEs on devices without ``torch._int_mm`` (Apple MPS) use dequantized weights.

Bug: an int8 checkpoint (``int8_tensorwise``, e.g. MiniMax H3's ``*_int8_convrot`` DiT and video VAE, or
``asym_w4a8_int8``) stops on a device whose torch has no int8 GEMM with
``NotImplementedError: The operator 'aten::_int_mm' is not currently implemented for the MPS device.``
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

Detection ("fixed upstream"), per kind of model (``MODEL_KINDS``): behavioural. A tiny int8 Linear built as that
kind's loader builds it for a device without int8 compute runs through ``forward`` and ``linear_input_act`` on CPU;
a kind whose results equal the dequantized weight's is fixed upstream, and the fix only when every kind is. At attach
time each real layer is asked the same, and a model with nothing left to divert gets nothing. A ``linear_input_act``
without ``linear``/``x``/``input_act``, or with a parameter it does not know and no default, disables it (drifted);
reordered parameters are read by name, and a core without ``linear_input_act`` gets ``forward`` diverted alone.

Off switch: ``MINIMAX_HOTFIX_DISABLE=int8_full_precision_mm``.

How (docs/int8_full_precision_mm.md has it step by step): an injection on MODEL, CLIP and VAE patchers; where the
load device fails a real ``torch._int_mm`` probe, each int8 layer the core would hand to it computes with its weight
dequantized (cached), and a wrapper of the free function ``comfy.ops.linear_input_act`` (no per-model hook reaches it)
diverts those layers and passes every other call through unchanged. Eject removes the layers' diversions and with them
their cached weights; the wrapper, installed at the first load that diverts a layer, stays for the rest of the process
(with no diverted layer left it hands every call to the stock function as it is).
"""

from __future__ import annotations

import inspect
import threading
import weakref

import torch

from ..contract import (
    AttributeOverride,
    Fix,
    Retirement,
    State,
    Status,
    Target,
    log,
    model_injection,
    set_injection,
)
from ..kernels.int8_full_precision_mm import (
    FUSED_PATHS,
    MARK,
    MODEL_KINDS,
    DequantizedInt8Linear,
    diverting_linear_input_act,
    equal_within_fp32_rounding,
    has_int8_gemm_weight,
    int8_compute_available,
    linear_input_act_drift,
    memory_guard,
    probe_paths,
    result_or_error,
)

FIX_ID = "int8_full_precision_mm"

class Int8FullPrecisionMM(Fix):
    id = FIX_ID
    targets = (Target.MODEL, Target.CLIP, Target.VAE)
    retirement = Retirement(
        fixed_by="Comfy-Org/ComfyUI PRs #16130 and #16285 for diffusion models and sd1_clip text encoders; none yet "
                 "for the MiniMax H3 video VAE or the Music 3 text encoder",
        delete_when="ComfyUI dequantizes every kind's int8 layers on devices without int8 compute (every kind reads "
                    "'fixed upstream' on every supported core)")

    def __init__(self):
        self._lock = threading.Lock()
        self._honours_full_precision_mm: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # comfy.ops: bool

    def detect(self) -> Status:
        try:
            import comfy.ops as ops
        except ImportError:
            ops = None
        if ops is None or not hasattr(ops, "mixed_precision_ops"):
            return Status(State.NOT_APPLICABLE, "no ComfyUI with int8 ops is importable here")
        drift = self._drift(ops)
        if drift:
            return Status(State.FAILED, f"target drifted: {drift}")
        reaching = self.kinds_reaching_int_mm(ops)
        parts = []
        for kind in MODEL_KINDS:
            paths = " and ".join(reaching[kind.name])
            verdict = (f"needs it: does not dequantize in {paths}" if paths
                       else f"fixed upstream: dequantizes in {' and '.join(FUSED_PATHS[hasattr(ops, 'linear_input_act')])}")
            parts.append(f"{kind.name} ({kind.target}) {verdict} ({kind.built_by})")
        if not any(reaching.values()):
            return Status(State.FIXED_UPSTREAM, "; ".join(parts))
        return Status(State.NEEDED, "; ".join(parts) + ". Diverted to a dequantized weight on devices where the op "
                                                        "is missing, for the kinds that need it")

    def kinds_reaching_int_mm(self, ops) -> dict[str, list[str]]:
        """For each model kind, the call paths on which a layer built as that kind's loader builds it for a device
        without int8 compute does not compute with its dequantized weight: it shows int8 activation rounding, or
        raises (from a missing ``_int_mm``, or from an int8 kernel that does not take the core's arguments); either
        way the fallback, which needs neither, is what computes right there."""
        import comfy.model_management as model_management

        reaching = {}
        with torch.no_grad():
            for kind in MODEL_KINDS:
                paths, reference, _ = probe_paths(ops, torch.device("cpu"), **kind.options(model_management))
                outcomes = {name: result_or_error(path, Exception) for name, path in paths.items()}
                reaching[kind.name] = [path for path, out in outcomes.items()
                                       if not (isinstance(out, torch.Tensor) and equal_within_fp32_rounding(out, reference))]
        return reaching

    @staticmethod
    def _drift(ops) -> str:
        fused = getattr(ops, "linear_input_act", None)  # a core without it has only Linear.forward to divert
        if fused and (drift := linear_input_act_drift(fused)):
            return drift
        import comfy.model_management
        needed = {ops: ("QuantizedTensor", "cast_bias_weight", "uncast_bias_weight", "run_every_op",
                        *(("INPUT_ACT_EAGER",) if fused else ())),
                  comfy.model_management: ("get_free_memory", "minimum_inference_memory")}
        if fused and "act_weight" in inspect.signature(fused).parameters:
            try:
                import comfy.rmsnorm
            except ImportError:
                return "comfy.rmsnorm is missing"
            needed[comfy.rmsnorm] = ("rms_norm",)
        for module, names in needed.items():
            missing = [name for name in names if not hasattr(module, name)]
            if missing:
                return f"{module.__name__} has no {', '.join(missing)}"
        if fused and "swiglu" not in ops.INPUT_ACT_EAGER:
            return "comfy.ops.INPUT_ACT_EAGER has no swiglu"
        return ""

    def attach(self, patcher, key: str) -> None:
        """Nothing is attached to a model whose int8 layers the core dequantizes itself (a kind fixed upstream)."""
        import comfy.ops as ops

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
        with self._lock:
            known = self._honours_full_precision_mm.get(ops)
            if known is None:
                with torch.no_grad():
                    paths, reference, _ = probe_paths(ops, torch.device("cpu"), full_precision_mm=True)
                    known = all(isinstance(out, torch.Tensor) and equal_within_fp32_rounding(out, reference)
                                for out in (result_or_error(path, Exception) for path in paths.values()))
                self._honours_full_precision_mm[ops] = known
            return known

    def injection(self):
        """Diverts the model's int8 layers after each load, but only when its load device lacks int8 compute, so a
        model on a CUDA device is left exactly as the stock loader made it."""
        divert = model_injection(self.divert_int8_layers, self)

        def inject(patcher) -> None:
            if not int8_compute_available(patcher.load_device):
                divert.inject(patcher)
            else:
                log.info("MiniMax Hotfix: %s hooked 0 module(s) of %s: %s has int8 compute", self.id,
                         type(patcher.model).__name__, patcher.load_device)
                self.link.hooked(patcher.model, 0)

        return type(divert)(inject=inject, eject=divert.eject)

    def divert_int8_layers(self, model) -> list:
        import comfy.model_management
        import comfy.ops as ops

        layers = [module for module in model.modules() if self.needs_diversion(module, ops)]
        if not layers:
            return []
        self.wrap_linear_input_act()
        may_keep = memory_guard(comfy.model_management, lambda device: log.info(
            "MiniMax Hotfix: %s: %s is nearly full; further int8 layers dequantize on every call instead of caching "
            "their weights", self.id, device))
        try:
            import comfy.rmsnorm as rmsnorm
        except ImportError:  # a core before linear_input_act's rms_norm input
            rmsnorm = None
        handles = []
        for layer in layers:
            fallback = DequantizedInt8Linear(layer, ops, rmsnorm, may_keep)
            handles += [AttributeOverride(layer, "forward", fallback.forward), AttributeOverride(layer, MARK, fallback)]
        log.info("MiniMax Hotfix: %s: %d int8 layers compute with dequantized weights where torch._int_mm is missing",
                 self.id, len(layers))
        return handles

    def wrap_linear_input_act(self) -> None:
        """Wrap ``comfy.ops.linear_input_act`` once (see the banner for why no per-model hook can)."""
        import comfy.ops as ops

        if hasattr(ops, "linear_input_act") and getattr(ops.linear_input_act, MARK, None) is None:
            ops.linear_input_act = diverting_linear_input_act(ops.linear_input_act)


FIX = Int8FullPrecisionMM()
