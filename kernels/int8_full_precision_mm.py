"""Tensor helpers for running int8-weight linears on devices without an int8 GEMM (``torch._int_mm``).

* ``int8_compute_available(device)``: whether ``torch._int_mm`` runs on that device, found by running it once on
  tiny tensors there (cached per device). Asking by device name would be wrong: MPS gained ``_int_mm`` in
  torch 2.15, and a build may lack it on any backend.
* ``DequantizedWeightCache``: one layer's dequantized weight, kept while the weight is unchanged, so the fallback
  does not dequantize on every call.
* ``DequantizedLinear``: a layer's replacement ``forward``: the layer's own (fused int8) forward where the input's
  device has int8 compute, ``F.linear`` with the cached dequantized weight where it has not.

* ``DequantizedInt8Linear``, ``diverting_linear_input_act``, ``has_int8_gemm_weight``, ``tiny_int8_linear``: the same
  for ComfyUI's int8 layers, with the running core's modules (``comfy.ops``, ...) passed in.
* ``MODEL_KINDS`` and ``probe_paths``: the ways ComfyUI's loaders build int8 layers, and a tiny layer's two call
  paths with their dequantized reference, which the fix's detection compares.

No ComfyUI imports here.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .tensor_versions import tensor_versions

# Layouts whose comfy-kitchen kernels multiply with torch._int_mm (ConvRot W4A4 multiplies in floating point).
INT8_GEMM_LAYOUTS = frozenset({"TensorWiseINT8Layout", "AsymW4A8Int8Layout"})
# Set on each diverted layer (its fallback object) and on the linear_input_act wrapper (the wrapper itself, so it is
# still found under a wrapper another pack puts on top with functools.wraps, which copies the attribute).
MARK = "_minimax_hotfix_int8_full_precision_mm"
# CUDA's _int_mm wants more than 16 rows and inner/outer sizes that are multiples of 8; 32 satisfies every backend.
_PROBE_SIZE = 32

_probe_lock = threading.Lock()
_int8_compute: dict[torch.device, bool] = {}

# linear_input_act's parameters as they grew (0.33.0 has the first three); the fallback takes them in this order.
LINEAR_INPUT_ACT_PARAMETERS = ("linear", "x", "input_act", "act_weight", "act_eps", "residual", "residual_scale")
FUSED_PATHS = {True: ("Linear.forward", "linear_input_act"), False: ("Linear.forward",)}  # by: has linear_input_act


def memory_guard(model_management, on_first_refusal: Callable[[object], None]) -> Callable[[int, object], bool]:
    """Cache a dequantized weight only while ComfyUI's own inference reserve stays free on its device: int8 is
    often chosen because memory is tight, and a full cache of a large DiT would not fit next to it.
    ``on_first_refusal(device)`` runs once, at the first weight refused."""
    told = False

    def may_keep(nbytes: int, device) -> bool:
        nonlocal told
        fits = model_management.get_free_memory(device) - nbytes >= model_management.minimum_inference_memory()
        if not fits and not told:
            told = True
            on_first_refusal(device)
        return fits

    return may_keep


def int8_compute_available(device) -> bool:
    """Whether ``torch._int_mm`` runs on ``device`` and returns the right numbers (probed once per device)."""
    found = _int8_compute.get(device)  # every diverted call asks with x.device: skip normalizing on a hit
    if found is None:
        device = torch.device(device)
        with _probe_lock:
            found = _int8_compute.get(device)
            if found is None:
                found = _int8_compute[device] = _probe_int_mm(device)
    return found


def _probe_int_mm(device: torch.device) -> bool:
    try:
        ones = torch.ones(_PROBE_SIZE, _PROBE_SIZE, dtype=torch.int8, device=device)
        return bool((torch._int_mm(ones, ones) == _PROBE_SIZE).all())
    # MPS before torch 2.15 raises NotImplementedError; a missing kernel elsewhere, or a device without data
    # (meta) when the result is read, raises RuntimeError
    except (NotImplementedError, RuntimeError):
        return False


class DequantizedWeightCache:
    """One layer's weight, dequantized to the compute dtype, kept until ComfyUI changes the weight.

    ComfyUI moves a weight or patches in a LoRA by installing a new Parameter (a different object) and writes in
    place through the tensors' version counters, so the entry is valid while the weight is the same object with the
    same versions on the same device, in the same dtype. One entry per layer: a layer computes on one device in one
    dtype, and a stale copy must not linger next to a fresh one.

    ``may_keep(nbytes, device)`` decides whether a fresh copy may stay resident; when it says no, the copy is used
    for this call only (dequantized again next call) so a tight device is not pushed out of memory.
    """

    def __init__(self, dequantize: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
                 may_keep: Callable[[int, torch.device], bool]):
        self._dequantize = dequantize
        self._may_keep = may_keep
        self._source: weakref.ref | None = None
        self._stamp: tuple | None = None
        self._weight: torch.Tensor | None = None

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        stamp = (weight.device, dtype, tensor_versions(weight))
        if self._weight is not None and self._source() is weight and self._stamp == stamp:
            return self._weight
        self.clear()  # free the stale copy before making the new one
        fresh = self._dequantize(weight, dtype)
        if self._may_keep(fresh.numel() * fresh.element_size(), weight.device):
            self._source, self._stamp, self._weight = weakref.ref(weight), stamp, fresh
        return fresh

    def clear(self) -> None:
        self._source = self._stamp = self._weight = None

    @property
    def nbytes(self) -> int:
        return 0 if self._weight is None else self._weight.numel() * self._weight.element_size()


def dequantizer(quantized_tensor: type) -> Callable[[torch.Tensor, torch.dtype], torch.Tensor]:
    """``dequantize(weight, dtype)``: a ``quantized_tensor`` weight dequantized to ``dtype``, any other weight cast."""

    def dequantize(weight, dtype):
        weight = weight.to(dtype=dtype)  # a QuantizedTensor only retags its output dtype here
        return weight.dequantize() if isinstance(weight, quantized_tensor) else weight

    return dequantize


class DequantizedLinear:
    """A replacement ``forward`` for one linear layer with an int8 weight: the layer's own forward (its fused int8
    kernel) where the input's device has int8 compute, else ``F.linear`` with the weight dequantized and cached.

    The device is checked on every call rather than once: the same model may compute on a device with the op and,
    after a move, on one without it."""

    def __init__(self, layer, dequantize: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
                 may_keep: Callable[[int, torch.device], bool]):
        self.layer = layer
        self.native_forward = layer.forward
        self.dequantize = dequantize
        self.weights = DequantizedWeightCache(dequantize, may_keep)

    def forward(self, x, *args, **kwargs):
        if int8_compute_available(x.device):
            return self.native_forward(x, *args, **kwargs)
        return self.linear(x)

    def linear(self, x):
        return self.dequantized_linear(x, self.layer.weight, self.layer.bias)

    def dequantized_linear(self, x, weight, bias):
        """``weight`` and ``bias`` already on ``x``'s device."""
        return F.linear(x, self.weights.get(weight, x.dtype), None if bias is None else bias.to(x.dtype))


class DequantizedInt8Linear(DequantizedLinear):
    """One ComfyUI int8 layer computed as ``F.linear(x, dequantized weight, bias)`` where ``x``'s device has no int8
    GEMM, in ``forward`` and in ``linear_input_act``."""

    def __init__(self, layer, ops, rmsnorm, may_keep):
        self.ops, self.rmsnorm = ops, rmsnorm  # comfy.ops and comfy.rmsnorm of the running core
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
            return self.rmsnorm.rms_norm(x, act_weight, act_eps)
        return self.ops.INPUT_ACT_EAGER[input_act](x)


def linear_input_act_drift(function) -> str:
    """Why the fallback cannot stand in for ``function`` (a core's ``linear_input_act``), or "": it must take
    ``linear``, ``x`` and ``input_act`` by name, and any parameter the fallback does not know must have a default (so a
    call that leaves it at its default means what the fallback computes)."""
    parameters = inspect.signature(function).parameters
    missing = [name for name in LINEAR_INPUT_ACT_PARAMETERS[:3] if name not in parameters]
    required = [name for name, parameter in parameters.items() if name not in LINEAR_INPUT_ACT_PARAMETERS
                and parameter.default is inspect.Parameter.empty]
    if missing or required:
        return (f"comfy.ops.linear_input_act{inspect.signature(function)} has unknown parameters "
                f"({', '.join(missing) + ' missing' if missing else ''}{'; ' if missing and required else ''}"
                f"{', '.join(required) + ' without a default' if required else ''})")
    return ""


def diverting_linear_input_act(stock):
    """``stock`` for every layer except those a fixed model marked, and for those too where int8 compute exists or the
    call passes a parameter the fallback does not know. The call is read by parameter name, so a core that reordered
    the parameters or added one with a default is diverted as well."""
    signature = inspect.signature(stock)
    linear_at = list(signature.parameters).index("linear")

    @functools.wraps(stock)
    def linear_input_act(*args, **kwargs):
        linear = args[linear_at] if len(args) > linear_at else kwargs.get("linear")
        fallback = getattr(linear, "__dict__", {}).get(MARK)
        if fallback is None:
            return stock(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments
        if int8_compute_available(given["x"].device) or not set(given) <= set(LINEAR_INPUT_ACT_PARAMETERS):
            return stock(*args, **kwargs)
        return fallback.linear_input_act(**{name: value for name, value in given.items() if name != "linear"})

    setattr(linear_input_act, MARK, linear_input_act)
    return linear_input_act


def has_int8_gemm_weight(module, quantized_tensor) -> bool:
    """A Linear-shaped layer (not an Embedding, not an expert bank) whose weight comfy-kitchen multiplies in int8."""
    weight = module._parameters.get("weight")
    return (isinstance(weight, quantized_tensor) and weight._layout_cls in INT8_GEMM_LAYOUTS and weight.dim() == 2
            and hasattr(module, "in_features") and not hasattr(module, "num_experts"))


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


def equal_within_fp32_rounding(result: torch.Tensor, reference: torch.Tensor) -> bool:
    """Equal within fp32 rounding; int8 activation rounding is ~1e-3 of the output scale, 100x above this."""
    return bool((result - reference).abs().max() <= 1e-5 * reference.abs().max())


def result_or_error(call, raised=(NotImplementedError, RuntimeError)):
    try:
        return call()
    except raised as exc:
        return exc


# Quant formats whose comfy-kitchen kernels need int8 compute: cores with #16130 disable them per load device.
INT8_COMPUTE_FORMATS = frozenset({"int8_tensorwise", "asym_w4a8_int8", "convrot_w4a4"})


@dataclass(frozen=True)
class ModelKind:
    """One way ComfyUI builds int8 layers: ``options(model_management)`` are the ``mixed_precision_ops`` options its
    loader passes for a load device without int8 compute; ``built_by`` says where and how, for the status reason."""

    name: str
    target: str  # the pack's Target value: model, clip or vae
    built_by: str
    options: object


def _diffusion_model_options(model_management) -> dict:
    """``pick_operations`` on cores with #16130 disables the int8 formats where ``supports_int8_compute`` says no (the
    query decides by device type: MPS is the device it answers no for on every such core), which marks the layers
    ``_full_precision_mm``; older cores disable no int8 format."""
    query = getattr(model_management, "supports_int8_compute", None)
    lacking = query is not None and not query(torch.device("mps"))
    return {"disabled": sorted(INT8_COMPUTE_FORMATS) if lacking else []}


# Every loader of ComfyUI that builds int8 layers, replayed by the fix's detection (docs/int8_full_precision_mm.md has
# the table, with the loaders that cannot).
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


def probe_paths(ops, device, **options):
    """An int8 layer of the running core on ``device``, built with ``mixed_precision_ops(..., **options)``: its two
    call paths by name (``Linear.forward``, and ``linear_input_act`` with swiglu where the core has it), their fp32
    reference with the dequantized weight, and the layer itself."""
    layer = tiny_int8_linear(ops, 64, 16, device=device, **options)
    gated = torch.randn(8, 128, generator=torch.Generator().manual_seed(1)).to(device)
    activated = (getattr(ops, "INPUT_ACT_EAGER", None) or _EAGER_SWIGLU)["swiglu"](gated)
    paths = {"Linear.forward": lambda: layer(activated)}
    if hasattr(ops, "linear_input_act"):  # by name: a core may have reordered its parameters
        paths["linear_input_act"] = lambda: ops.linear_input_act(linear=layer, x=gated, input_act="swiglu")
    return paths, F.linear(activated, layer.weight.dequantize()), layer


def _swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


_EAGER_SWIGLU = {"swiglu": _swiglu}  # ComfyUI's definition, for a core without INPUT_ACT_EAGER
