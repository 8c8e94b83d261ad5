"""int8_full_precision_mm: int8 layers on a device without torch._int_mm, simulated on CPU by making the op raise
the MPS error, with a red control (stock layers reach the op) before each green run.

Tests taking ``core`` run on a stand-in core (CI) and, with COMFYUI_PATH, on ComfyUI's own comfy.ops and
ModelPatcher. The stand-in models the slice of ComfyUI 0.33.0 the fix touches: ``mixed_precision_ops(...).Linear``
loads an int8 state dict into a comfy-kitchen QuantizedTensor and hands it to ``F.linear`` (so ``forward`` reaches
``torch._int_mm``), ``linear_input_act`` (newest signature, so the rms_norm and residual forms run here too) calls
comfy-kitchen's ``int8_linear``, plus ``cast_bias_weight`` and the memory queries. Flags turn on the upstream fixes
(#16130 in forward, #16285 in linear_input_act) for the detection tests. Numbers are printed (``pytest -s``).
"""

import functools
import inspect
import json
import sys
import types

import comfy_kitchen
import pytest
import torch
import torch.nn.functional as F
from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout
from torch import nn

from hotfix_testing.comfy_memory import unload_all_models
from hotfix_testing.patchers import StandInPatcher
from minimax_hotfix.contract import State
from minimax_hotfix.diagnostics import self_test
from minimax_hotfix.diagnostics.self_tests.int8_full_precision_mm import (
    MPS_INT_MM_ERROR,
    forget_int8_probes,
    unwrap_linear_input_act,
)
from minimax_hotfix.kernels.int8_full_precision_mm import DequantizedLinear, int8_compute_available
from minimax_hotfix.patches import int8_full_precision_mm
from minimax_hotfix.patches.int8_full_precision_mm import FIX, MARK, MODEL_KINDS
from minimax_hotfix.registry import key_for

KEY = key_for(FIX)
NEWEST_PARAMETERS = ("linear", "x", "input_act", "act_weight", "act_eps", "residual", "residual_scale")


# ---------------------------------------------------------------------------------------------------- stand-in core

def eager_input_act(x, input_act, act_weight=None, act_eps=0.0):
    if input_act == "rms_norm":
        return F.rms_norm(x, (x.shape[-1],), act_weight, act_eps)
    if input_act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def standin_core(forward_dequantizes=False, fused_dequantizes=False, parameters=NEWEST_PARAMETERS,
                 int8_compute_query=False):
    """``comfy``, ``comfy.ops``, ``comfy.model_management`` and ``comfy.rmsnorm`` as modules of a stand-in core."""
    ops = types.ModuleType("comfy.ops")
    ops.QuantizedTensor = QuantizedTensor
    ops.INPUT_ACT_EAGER = {"gelu_tanh": lambda x: eager_input_act(x, "gelu_tanh"),
                           "swiglu": lambda x: eager_input_act(x, "swiglu")}
    ops.run_every_op = lambda: None

    def cast_bias_weight(layer, input, offloadable=False):
        weight = layer.weight.to(device=input.device)
        bias = None if layer.bias is None else layer.bias.to(device=input.device, dtype=input.dtype)
        if layer.weight_function or weight.dtype != input.dtype:
            weight = weight.to(dtype=input.dtype)
            weight = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
            for function in layer.weight_function:
                weight = function(weight)
        return weight, bias, None

    ops.cast_bias_weight = cast_bias_weight
    ops.uncast_bias_weight = lambda layer, weight, bias, offload_stream: None

    class Linear(nn.Module):
        compute_dtype = torch.bfloat16
        _full_precision_mm = False
        disabled_formats = ()

        def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
            super().__init__()
            self.in_features, self.out_features, self.device = in_features, out_features, device
            self.weight_function, self.bias_function = [], []
            self.register_parameter("weight", None)
            self.bias = None if not bias else nn.Parameter(torch.zeros(out_features, dtype=self.compute_dtype,
                                                                       device=device))

        def _load_from_state_dict(self, state_dict, prefix, *args):
            conf = json.loads(bytes(state_dict.pop(prefix + "comfy_quant").tolist()))
            assert conf["format"] == "int8_tensorwise"
            if conf["format"] in self.disabled_formats:
                self._full_precision_mm = True
            params = TensorWiseINT8Layout.Params(
                scale=state_dict.pop(prefix + "weight_scale").to(self.device), orig_dtype=self.compute_dtype,
                orig_shape=(self.out_features, self.in_features), convrot=conf.get("convrot", False),
                convrot_groupsize=conf.get("convrot_groupsize", 256))
            qdata = state_dict.pop(prefix + "weight").to(self.device)
            self.weight = nn.Parameter(QuantizedTensor(qdata, "TensorWiseINT8Layout", params), requires_grad=False)
            super()._load_from_state_dict(state_dict, prefix, *args)

        def forward(self, x):
            weight, bias, _ = cast_bias_weight(self, x, offloadable=True)
            if forward_dequantizes and self._full_precision_mm and isinstance(weight, QuantizedTensor):
                weight = weight.dequantize()
            return F.linear(x, weight, bias)  # a QuantizedTensor weight dispatches to comfy-kitchen's int8_linear

    def mixed_precision_ops(quant_config=None, compute_dtype=torch.bfloat16, full_precision_mm=False, disabled=()):
        attributes = {"compute_dtype": compute_dtype, "_full_precision_mm": full_precision_mm,
                      "disabled_formats": tuple(disabled)}
        return types.SimpleNamespace(Linear=type("Linear", (Linear,), attributes))

    ops.mixed_precision_ops = mixed_precision_ops

    def linear_input_act(linear, x, input_act, *args, **kwargs):
        bound = signature.bind(linear, x, input_act, *args, **kwargs)
        bound.apply_defaults()
        extra = bound.arguments
        activated = eager_input_act(x, input_act, extra.get("act_weight"), extra.get("act_eps", 0.0))
        weight = linear.weight
        if (not isinstance(weight, QuantizedTensor) or weight._layout_cls != "TensorWiseINT8Layout"
                or (fused_dequantizes and linear._full_precision_mm)):
            out = linear(activated)
        else:
            out = comfy_kitchen.int8_linear(activated, weight._qdata, weight._params.scale, linear.bias, x.dtype,
                                            convrot=weight._params.convrot,
                                            convrot_groupsize=weight._params.convrot_groupsize)
        residual = extra.get("residual")
        return out if residual is None else torch.addcmul(residual, out, extra["residual_scale"])

    defaults = {"act_weight": None, "act_eps": 0.0, "residual": None, "residual_scale": None}
    signature = inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                     default=defaults.get(name, inspect.Parameter.empty))
                                   for name in parameters])
    linear_input_act.__signature__ = signature
    ops.linear_input_act = linear_input_act

    model_management = types.ModuleType("comfy.model_management")
    model_management.minimum_inference_memory = lambda: 1 << 30
    model_management.get_free_memory = lambda dev=None, torch_free_too=False: 1 << 40
    if int8_compute_query:  # #16130: pick_operations disables the int8 formats where this says no
        model_management.supports_int8_compute = lambda device=None: torch.device(device).type != "mps"
    rmsnorm = types.ModuleType("comfy.rmsnorm")
    rmsnorm.rms_norm = lambda x, weight=None, eps=1e-6: F.rms_norm(x, (x.shape[-1],), weight, eps)
    comfy = types.ModuleType("comfy")
    comfy.ops, comfy.model_management, comfy.rmsnorm = ops, model_management, rmsnorm
    return {"comfy": comfy, "comfy.ops": ops, "comfy.model_management": model_management, "comfy.rmsnorm": rmsnorm}


def use_modules(monkeypatch, modules):
    for name in ("comfy", "comfy.ops", "comfy.model_management", "comfy.rmsnorm"):
        monkeypatch.setitem(sys.modules, name, modules[name])


class Core:
    """One core under test: its modules, how it builds int8 layers, and how its patchers load and unload."""

    def __init__(self, name, modules):
        self.name, self.ops, self.mm = name, modules["comfy.ops"], modules["comfy.model_management"]
        self.loaded = []

    def int8_linear(self, in_features, out_features, bias=False, convrot=True, full_precision_mm=False,
                    dtype=torch.float32, seed=0):
        """Built the way ComfyUI's tests-unit/comfy_quant tests build it: a comfy-kitchen int8 weight (per channel,
        ConvRot) stored as a checkpoint stores it, loaded into ``mixed_precision_ops(...).Linear``."""
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(out_features, in_features, generator=generator)
        quantized = QuantizedTensor.from_float(weight, "TensorWiseINT8Layout", per_channel=True, convrot=convrot,
                                               convrot_groupsize=256)
        conf = {"format": "int8_tensorwise", "convrot": convrot, "convrot_groupsize": 256}
        state_dict = {"weight": quantized._qdata, "weight_scale": quantized._params.scale,
                      "comfy_quant": torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)}
        if bias:
            state_dict["bias"] = torch.randn(out_features, generator=generator).to(dtype)
        layer = self.ops.mixed_precision_ops({}, dtype, full_precision_mm=full_precision_mm).Linear(
            in_features, out_features, bias=bias, device="cpu")
        layer.load_state_dict(state_dict, strict=False)
        assert isinstance(layer.weight, QuantizedTensor)
        return layer

    def mlp(self, full_precision_mm=False, dtype=torch.float32):
        """The H3 DiT MLP's shape: fc2(swiglu(fc1(x))), fc2 through linear_input_act, looked up at call time."""
        ops = self.ops

        class MLP(nn.Module):
            def __init__(inner):  # noqa: N805 (``self`` is the test kit whose int8 layers it takes)
                super().__init__()
                options = {"full_precision_mm": full_precision_mm, "dtype": dtype}
                inner.fc1 = self.int8_linear(256, 512, seed=1, **options)
                inner.fc2 = self.int8_linear(256, 256, bias=True, seed=2, **options)

            def forward(inner, x):  # noqa: N805
                return ops.linear_input_act(inner.fc2, inner.fc1(x), "swiglu")

        return MLP()

    def patcher(self, model):
        return StandInPatcher(model)

    def load(self, patcher):
        patcher.inject_model()
        self.loaded.append(patcher)

    def unload_all(self):
        while self.loaded:
            self.loaded.pop().eject_model()


class ComfyCore(Core):
    def __init__(self):
        import comfy.model_management
        import comfy.model_patcher
        import comfy.ops

        super().__init__("comfyui", {"comfy.ops": comfy.ops, "comfy.model_management": comfy.model_management})
        self.model_patcher = comfy.model_patcher

    def patcher(self, model):
        cpu = torch.device("cpu")
        return self.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)

    def load(self, patcher):
        self.mm.load_models_gpu([patcher], force_full_load=True)
        self.loaded.append(patcher)  # ComfyUI holds patchers weakly: a collected one counts as unloaded

    def unload_all(self):
        unload_all_models()
        self.loaded.clear()


@pytest.fixture(params=["stand-in", "comfyui"])
def core(request, monkeypatch):
    if request.param == "stand-in":
        use_modules(monkeypatch, standin_core())
        the_core = Core("stand-in", sys.modules)
    else:
        request.getfixturevalue("comfyui")
        the_core = ComfyCore()
    yield the_core
    the_core.unload_all()
    unwrap_linear_input_act()


class IntMM:
    """torch._int_mm as the test needs it: the real op, the op missing (raising the MPS error), or counted."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.real, self.calls = monkeypatch, torch._int_mm, 0

    def _use(self, op):
        self.monkeypatch.setattr(torch, "_int_mm", op)
        forget_int8_probes()

    def remove(self):
        def missing(*args, **kwargs):
            raise NotImplementedError(MPS_INT_MM_ERROR)

        self._use(missing)

    def count(self):
        def counting(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)

        self._use(counting)
        int8_compute_available("cpu")  # probe now, so that only the model's calls are counted
        self.calls = 0


@pytest.fixture
def int_mm(monkeypatch):
    forget_int8_probes()
    yield IntMM(monkeypatch)
    forget_int8_probes()


def attached(core, model):
    patcher = core.patcher(model)
    FIX.attach(patcher, KEY)
    return patcher


def input_act_cases(ops, width):
    """(input_act, extra arguments, input width) for every input_act the core's linear_input_act supports."""
    generator = torch.Generator().manual_seed(7)
    cases = [(name, (), {}, 2 * width if name == "swiglu" else width) for name in ops.INPUT_ACT_EAGER]
    parameters = inspect.signature(ops.linear_input_act).parameters
    norm = (torch.rand(width, generator=generator) + 0.5, 1e-6)
    if "act_weight" in parameters:
        cases.append(("rms_norm", norm, {}, width))
    if "residual" in parameters:
        residual = {"residual": torch.randn(4, width, generator=generator),
                    "residual_scale": torch.randn(width, generator=generator)}
        cases += [("swiglu", (), residual, 2 * width), ("rms_norm", norm, residual, width)]
    return [(name, args, kwargs, torch.randn(4, w, generator=generator)) for name, args, kwargs, w in cases]


def reference(layer, x, input_act=None, args=(), kwargs=None):
    """fp32 linear_input_act with the dequantized weight."""
    kwargs = kwargs or {}
    activated = eager_input_act(x.float(), input_act, *[a.float() if torch.is_tensor(a) else a for a in args]) \
        if input_act else x.float()
    bias = None if layer.bias is None else layer.bias.float()
    out = F.linear(activated, layer.weight.dequantize().float(), bias)
    if kwargs.get("residual") is not None:
        out = torch.addcmul(kwargs["residual"].float(), out, kwargs["residual_scale"].float())
    return activated, out


def activation_rounding_bound(activated, weight):
    """Largest |fused int8 - dequantized linear| the int8 kernel's activation rounding can cause, per output.

    Both sides multiply by the same weight: the int8 payload times its scale is the dequantized weight (rotated by
    the orthonormal ConvRot Hadamard when convrot is on). Only the activation differs: the kernel rounds each
    (rotated) row a' to int8 with step s = max|a'|/127, an error of at most s/2 per element. Hence
      without rotation:  |dy[r,n]| <= s_r/2 * ||W[n]||_1,                     s_r = max|a[r]| / 127
      with ConvRot:      |dy[r,n]| <= ||da'[r]||_2 ||W[n]||_2 <= sqrt(K) s_r/2 ||W[n]||_2,  s_r <= ||a[r]||_2 / 127
    (the rotation keeps L2 norms, and no rotated element exceeds its row's L2 norm)."""
    w = weight.dequantize().float()
    a = activated.float().reshape(-1, w.shape[1])
    if weight._params.convrot:
        rotated_rows = weight._qdata.float() * weight._params.scale.float()
        assert torch.allclose(rotated_rows.norm(dim=1), w.norm(dim=1), rtol=1e-4), "ConvRot is not orthonormal"
        return (w.shape[1] ** 0.5 * a.norm(dim=1, keepdim=True) / 254) * w.norm(dim=1)
    return (a.abs().amax(dim=1, keepdim=True) / 254) * w.abs().sum(dim=1)


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


# -------------------------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("full_precision_mm", [False, True], ids=["dit", "text-encoder"])
def test_red_stock_int8_layers_reach_int_mm_on_both_paths(core, int_mm, full_precision_mm):
    """Red control: without the fix both call paths stop at torch._int_mm, even for _full_precision_mm layers
    (ComfyUI gives text encoders full_precision_mm=True)."""
    mlp = core.mlp(full_precision_mm)
    core.load(core.patcher(mlp))
    int_mm.remove()
    with pytest.raises(NotImplementedError, match=r"aten::_int_mm.*MPS"):
        mlp.fc1(torch.randn(4, 256))
    with pytest.raises(NotImplementedError, match=r"aten::_int_mm.*MPS"):
        core.ops.linear_input_act(mlp.fc2, torch.randn(4, 512), "swiglu")


@pytest.mark.parametrize("full_precision_mm", [False, True], ids=["dit", "text-encoder"])
def test_green_both_paths_compute_with_the_dequantized_weight(core, int_mm, full_precision_mm):
    mlp = core.mlp(full_precision_mm)
    cases = input_act_cases(core.ops, 256)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    fused_forward = mlp.fc1(x)  # the real op, before it goes missing
    fused = [core.ops.linear_input_act(mlp.fc2, h, name, *args, **kwargs) for name, args, kwargs, h in cases]

    int_mm.remove()
    core.load(attached(core, mlp))
    results = [("forward", mlp.fc1, {}, mlp.fc1(x), fused_forward, *reference(mlp.fc1, x))]
    for (name, args, kwargs, h), fused_out in zip(cases, fused, strict=True):
        out = core.ops.linear_input_act(mlp.fc2, h, name, *args, **kwargs)
        results.append((f"linear_input_act {name}{' +residual' if kwargs else ''}", mlp.fc2, kwargs, out, fused_out,
                        *reference(mlp.fc2, h, name, args, kwargs)))
    mlp(x)  # the whole block, as the DiT calls it

    for label, layer, kwargs, out, fused_out, activated, ref in results:
        scale = ref.abs().max().item()
        bound = activation_rounding_bound(activated, layer.weight) * kwargs.get("residual_scale", torch.ones(1)).abs()
        print(f"[{core.name}] {label}: max|fallback - fp32 ref| = {max_diff(out, ref):.2e}, "
              f"max|fallback - fused int8| = {max_diff(out, fused_out):.2e} (bound {bound.min().item():.2e}.."
              f"{bound.max().item():.2e}), output scale {scale:.1f}")
        assert max_diff(out, ref) <= 1e-5 * scale, label
        assert ((out - fused_out).abs() <= bound + 1e-5 * scale).all(), label


def test_bfloat16_fallback_matches_the_fp32_reference_within_bfloat16_rounding(core, int_mm):
    mlp = core.mlp(dtype=torch.bfloat16)
    int_mm.remove()
    core.load(attached(core, mlp))
    h = torch.randn(4, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = core.ops.linear_input_act(mlp.fc2, h, "swiglu")
    _, ref = reference(mlp.fc2, h, "swiglu")
    assert out.dtype == torch.bfloat16
    print(f"[{core.name}] bf16 linear_input_act swiglu: max|fallback - fp32 ref| = {max_diff(out, ref):.2e} "
          f"of output scale {ref.abs().max().item():.1f}")
    assert max_diff(out, ref) <= 2 ** -7 * ref.abs().max().item()


def test_only_activation_rounding_separates_fallback_and_fused_results(core, int_mm):
    """Activations the int8 kernel represents exactly (integers, each row's largest magnitude 127, no rotation):
    the fused result and the fallback then agree to fp32 rounding, so the weights used are the same."""
    layer = core.int8_linear(256, 64, bias=True, convrot=False)
    x = torch.randint(-127, 128, (4, 256), generator=torch.Generator().manual_seed(5)).float()
    x[:, 0] = 127
    fused = layer(x)
    int_mm.remove()
    core.load(attached(core, nn.ModuleList([layer])))
    out = layer(x)
    print(f"[{core.name}] exactly representable activations: max|fallback - fused int8| = {max_diff(out, fused):.2e}")
    assert max_diff(out, fused) <= 1e-5 * fused.abs().max().item()


def test_fused_int8_kernel_still_runs_where_int_mm_exists(core, int_mm):
    """A spy on torch._int_mm: where the op runs, attaching the fix leaves both paths on the fused int8 kernel; a
    model diverted while its device lacked the op goes back to the kernel per call once the op is there."""
    mlp = core.mlp()
    h, x = torch.randn(4, 512), torch.randn(4, 256)
    stock = [mlp.fc1(x), core.ops.linear_input_act(mlp.fc2, h, "swiglu")]

    int_mm.count()
    patcher = attached(core, mlp)
    core.load(patcher)
    assert MARK not in vars(mlp.fc1) and "forward" not in vars(mlp.fc1), "nothing is attached where int8 runs"
    kept = [mlp.fc1(x), core.ops.linear_input_act(mlp.fc2, h, "swiglu")]
    assert int_mm.calls == 2 and all(map(torch.equal, kept, stock))

    core.unload_all()
    int_mm.remove()
    core.load(patcher)
    assert MARK in vars(mlp.fc1)
    int_mm.count()
    again = [mlp.fc1(x), core.ops.linear_input_act(mlp.fc2, h, "swiglu")]
    assert int_mm.calls == 2 and all(map(torch.equal, again, stock))


@pytest.fixture
def dequantize_calls(monkeypatch):
    calls = []
    real = QuantizedTensor.dequantize

    def counting(self, *args, **kwargs):
        calls.append(self.shape)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(QuantizedTensor, "dequantize", counting)
    return calls


def test_weight_is_dequantized_once_until_comfyui_replaces_or_rewrites_it(core, int_mm, dequantize_calls):
    mlp = core.mlp()
    int_mm.remove()
    core.load(attached(core, mlp))
    h = torch.randn(4, 512)
    for _ in range(3):
        core.ops.linear_input_act(mlp.fc2, h, "swiglu")
        mlp.fc2(eager_input_act(h, "swiglu"))
    assert len(dequantize_calls) == 1, "an unchanged weight is dequantized once"
    cached = vars(mlp.fc2)[MARK].weights.nbytes
    print(f"[{core.name}] cache for a 256x256 int8 weight (64 KiB): {cached // 1024} KiB in fp32")
    assert cached == 256 * 256 * 4

    # what a move or a LoRA patch does to a quantized layer: a new Parameter
    new = torch.randn(256, 256)
    mlp.fc2.weight = nn.Parameter(QuantizedTensor.from_float(new, "TensorWiseINT8Layout", per_channel=True),
                                  requires_grad=False)
    out = core.ops.linear_input_act(mlp.fc2, h, "swiglu")
    assert max_diff(out, reference(mlp.fc2, h, "swiglu")[1]) <= 1e-5 * out.abs().max().item()
    mlp.fc2.weight._qdata.neg_()  # an in-place write
    out = core.ops.linear_input_act(mlp.fc2, h, "swiglu")
    assert max_diff(out, reference(mlp.fc2, h, "swiglu")[1]) <= 1e-5 * out.abs().max().item()
    assert len(dequantize_calls) == 1 + 2 + 2  # each change: the cache refills once, the reference once


def test_a_lora_comfyui_patches_in_reaches_the_fallback(comfyui, int_mm):
    """ComfyUI's own weight patching (add_patches, then a load requantizes the int8 weight into a new Parameter)."""
    core = ComfyCore()
    mlp = core.mlp()
    int_mm.remove()
    patcher = attached(core, mlp)
    core.load(patcher)
    h = torch.randn(4, 512)
    before = core.ops.linear_input_act(mlp.fc2, h, "swiglu")
    with_lora = patcher.clone()
    with_lora.add_patches({"fc2.weight": (torch.randn(256, 256) * 0.5,)}, 1.0)
    try:
        core.load(with_lora)
        after = core.ops.linear_input_act(mlp.fc2, h, "swiglu")
        expected = reference(mlp.fc2, h, "swiglu")[1]
    finally:
        core.unload_all()
        unwrap_linear_input_act()
    assert max_diff(after, expected) <= 1e-5 * expected.abs().max().item()
    assert max_diff(after, before) > 1, "the patched weight is used, not the cached one"


def test_offloaded_or_on_the_fly_patched_weight_is_cast_per_call(core, int_mm, dequantize_calls):
    """A LoRA applied on the fly (ComfyUI's lowvram weight_function) must reach the result, so such a layer goes
    through ComfyUI's cast every call instead of the cache."""
    mlp = core.mlp()
    int_mm.remove()
    core.load(attached(core, mlp))
    delta = torch.randn(256, 256) * 0.1
    mlp.fc2.weight_function = [lambda weight: weight + delta]
    h = torch.randn(4, 512)
    for _ in range(2):
        out = core.ops.linear_input_act(mlp.fc2, h, "swiglu")
    expected = F.linear(eager_input_act(h, "swiglu"), mlp.fc2.weight.dequantize() + delta, mlp.fc2.bias)
    assert max_diff(out, expected) <= 1e-5 * expected.abs().max().item()
    assert vars(mlp.fc2)[MARK].weights.nbytes == 0 and len(dequantize_calls) == 2 + 1


def test_memory_guard_keeps_no_copy_on_a_full_device(core, int_mm, dequantize_calls, monkeypatch):
    mlp = core.mlp()
    int_mm.remove()
    core.load(attached(core, mlp))
    monkeypatch.setattr(core.mm, "get_free_memory",
                        lambda dev=None, torch_free_too=False: core.mm.minimum_inference_memory())
    h = torch.randn(4, 512)
    outs = [core.ops.linear_input_act(mlp.fc2, h, "swiglu") for _ in range(2)]
    expected = reference(mlp.fc2, h, "swiglu")[1]
    assert torch.equal(*outs) and max_diff(outs[0], expected) <= 1e-5 * expected.abs().max().item()
    assert vars(mlp.fc2)[MARK].weights.nbytes == 0 and len(dequantize_calls) == 2 + 1


def test_only_the_fixed_model_is_diverted_and_unloading_restores_it(core, int_mm):
    fixed, stock = core.mlp(), core.mlp()
    int_mm.remove()
    core.load(attached(core, fixed))
    core.load(core.patcher(stock))
    h = torch.randn(4, 512)
    core.ops.linear_input_act(fixed.fc2, h, "swiglu")
    with pytest.raises(NotImplementedError, match="_int_mm"):
        core.ops.linear_input_act(stock.fc2, h, "swiglu")

    core.unload_all()
    assert not {MARK, "forward"} & set(vars(fixed.fc2)), "ejecting removes the marks, forwards and caches"
    with pytest.raises(NotImplementedError, match="_int_mm"):
        core.ops.linear_input_act(fixed.fc2, h, "swiglu")


def test_clone_carries_the_fix(core, int_mm):
    mlp = core.mlp()
    clone = attached(core, mlp).clone()
    int_mm.remove()
    core.load(clone)
    mlp(torch.randn(4, 256))


def test_loaders_attach_it_to_model_and_clip_and_the_off_switch_keeps_it_off(core, int_mm, registry, fresh_detection,
                                                                              monkeypatch):
    """The path the pack's loaders and Apply nodes take (pack_registry.attach_fixes), for a DiT-like MODEL and a text
    encoder-like CLIP patcher; MINIMAX_HOTFIX_DISABLE leaves the stock behaviour."""
    from minimax_hotfix import registry as pack_registry

    registry(FIX)
    int_mm.remove()
    for target, full_precision_mm in (("model", False), ("clip", True)):
        mlp = core.mlp(full_precision_mm)
        patcher = core.patcher(mlp)
        assert pack_registry.attach_fixes(patcher, target) == [FIX.id]
        assert pack_registry.attach_fixes(patcher, target) == [FIX.id] and len(patcher.get_injections(KEY)) == 1
        core.load(patcher)
        mlp(torch.randn(4, 256))
        core.unload_all()

    monkeypatch.setenv(pack_registry.DISABLE_ENV, FIX.id)
    mlp = core.mlp()
    patcher = core.patcher(mlp)
    assert pack_registry.attach_fixes(patcher, "model") == []
    core.load(patcher)
    with pytest.raises(NotImplementedError, match="_int_mm"):
        mlp(torch.randn(4, 256))


def test_linear_input_act_wrapper_is_installed_once_and_removed_again(core):
    stock = core.ops.linear_input_act
    FIX.wrap_linear_input_act()
    wrapper = core.ops.linear_input_act
    FIX.wrap_linear_input_act()
    assert core.ops.linear_input_act is wrapper and wrapper.__wrapped__ is stock
    assert inspect.signature(wrapper) == inspect.signature(stock)
    unwrap_linear_input_act()
    assert core.ops.linear_input_act is stock

    FIX.wrap_linear_input_act()
    ours = core.ops.linear_input_act
    other_pack = functools.wraps(ours)(lambda *args, **kwargs: ours(*args, **kwargs))
    core.ops.linear_input_act = other_pack
    FIX.wrap_linear_input_act()
    assert core.ops.linear_input_act is other_pack, "ours is found under another pack's wrapper, not stacked"
    unwrap_linear_input_act()
    assert core.ops.linear_input_act is other_pack, "removing ours from under theirs would drop theirs"
    core.ops.linear_input_act = stock


def test_self_test_red_then_green(core):
    checks = list(self_test(FIX))
    assert [check.name.split(":")[0] for check in checks] == ["red", "green", "green"], checks
    assert all(check.passed for check in checks), checks


BOTH_PATHS = "needs it: does not dequantize in Linear.forward and linear_input_act"
FUSED_PATH = "needs it: does not dequantize in linear_input_act"
FIXED = "fixed upstream: dequantizes in Linear.forward and linear_input_act"


@pytest.mark.parametrize("forward_dequantizes, fused_dequantizes, int8_compute_query, expected", [
    (False, False, False, [BOTH_PATHS] * 4),  # 0.33.0
    (True, False, True, [FUSED_PATH, FUSED_PATH, BOTH_PATHS, BOTH_PATHS]),  # #16130 only, e.g. the seed's 0.35.1
    (True, True, True, [FIXED, FIXED, BOTH_PATHS, BOTH_PATHS]),  # #16130 + #16285
    (True, True, False, [BOTH_PATHS, FIXED, BOTH_PATHS, BOTH_PATHS]),  # no query: nothing marks the DiT's layers
], ids=["0.33.0", "16130", "16130+16285", "16285-without-query"])
def test_detection_per_model_kind(monkeypatch, forward_dequantizes, fused_dequantizes, int8_compute_query,
                                  expected):
    """Diffusion model, text encoder, Music 3 text encoder, H3 video VAE: the fix stays applied while any needs it."""
    use_modules(monkeypatch, standin_core(forward_dequantizes, fused_dequantizes,
                                          int8_compute_query=int8_compute_query))
    found = FIX.detect()
    assert found.state is State.NEEDED, found
    for kind, verdict in zip(MODEL_KINDS, expected, strict=True):
        assert f"{kind.name} ({kind.target}) {verdict} (" in found.reason, (kind.name, found.reason)


def test_fixed_upstream_only_when_every_model_kind_is(monkeypatch):
    use_modules(monkeypatch, standin_core(True, True, int8_compute_query=True))
    monkeypatch.setattr(int8_full_precision_mm, "MODEL_KINDS", MODEL_KINDS[:2])  # a core that fixed the others too
    assert FIX.detect().state is State.FIXED_UPSTREAM


def test_detection_on_the_0_33_0_signature_and_on_a_drifted_one(monkeypatch):
    use_modules(monkeypatch, standin_core(parameters=NEWEST_PARAMETERS[:3]))
    assert FIX.detect().state is State.NEEDED
    use_modules(monkeypatch, standin_core(parameters=("linear", "x", "input_act", "act_scale")))
    found = FIX.detect()
    assert found.state is State.FAILED and "act_scale" in found.reason, found


def test_detection_without_comfyui(monkeypatch):
    for name in ("comfy", "comfy.ops"):
        monkeypatch.setitem(sys.modules, name, None)  # import of these now fails
    assert FIX.detect().state is State.NOT_APPLICABLE
    checks = list(self_test(FIX))  # comfy-kitchen's own int8 linear, diverted by the pack's kernel
    assert [check.name.split(":")[0] for check in checks] == ["red", "green", "green"], checks
    assert all(check.passed for check in checks), checks
    assert "comfy-kitchen" in checks[0].name and "_int_mm" in checks[0].detail


def test_kernel_self_test_fails_when_the_diversion_does_nothing(monkeypatch):
    for name in ("comfy", "comfy.ops"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(DequantizedLinear, "forward", lambda self, x: self.native_forward(x))
    with pytest.raises(NotImplementedError, match=r"aten::_int_mm"):
        list(self_test(FIX))


@pytest.mark.parametrize("target", ["model", "clip"])
def test_real_minimax_h3_and_text_encoder_mlps(comfyui, int_mm, target):
    """ComfyUI's own MLP classes (the H3 DiT's and the Llama/Qwen3 text encoder's merged MLP, both calling
    comfy.ops.linear_input_act) with int8 weights built as tests-unit/comfy_quant builds them, under a real
    ModelPatcher: red without the fix, green with it."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ops
    import comfy.utils

    hidden, ffn = 256, 256
    generator = torch.Generator().manual_seed(11)
    if target == "model":
        from comfy.ldm.minimax.model import MLP

        operations = comfy.ops.mixed_precision_ops({}, torch.float32)
        mlp, names = MLP(hidden, ffn, operations=operations), {"fc1": (2 * ffn, hidden), "fc2": (hidden, ffn)}
    else:
        from comfy.text_encoders.llama import MLP

        config = types.SimpleNamespace(hidden_size=hidden, intermediate_size=ffn, merged_mlp=True,
                                       mlp_activation="silu")
        operations = comfy.ops.mixed_precision_ops({}, torch.float32, full_precision_mm=True)  # as sd1_clip does
        mlp, names = MLP(config, ops=operations), {"gate_up_proj": (2 * ffn, hidden), "down_proj": (hidden, ffn)}
    state_dict, layers = {}, {}
    for name, shape in names.items():
        quantized = QuantizedTensor.from_float(torch.randn(*shape, generator=generator), "TensorWiseINT8Layout",
                                               per_channel=True, convrot=True, convrot_groupsize=256)
        state_dict[f"{name}.weight"], state_dict[f"{name}.weight_scale"] = quantized._qdata, quantized._params.scale
        layers[name] = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    state_dict, _ = comfy.utils.convert_old_quants(
        state_dict, metadata={"_quantization_metadata": json.dumps({"layers": layers})})
    mlp.load_state_dict(state_dict, strict=False)
    first, second = (getattr(mlp, name) for name in names)
    x = torch.randn(4, hidden, generator=generator)
    _, expected = reference(second, reference(first, x)[1], "swiglu")

    cpu = torch.device("cpu")
    stock = comfy.model_patcher.ModelPatcher(mlp, load_device=cpu, offload_device=cpu)
    comfy.model_management.load_models_gpu([stock], force_full_load=True)
    int_mm.remove()
    with pytest.raises(NotImplementedError, match=r"aten::_int_mm"):
        mlp(x)

    unload_all_models()
    fixed = stock.clone()
    FIX.attach(fixed, KEY)
    try:
        comfy.model_management.load_models_gpu([fixed], force_full_load=True)
        out = mlp(x)
    finally:
        unload_all_models()
        unwrap_linear_input_act()
    print(f"[comfyui] real {type(mlp).__module__}.MLP ({target}): "
          f"max|fallback - fp32 ref| = {max_diff(out, expected):.2e}")
    assert max_diff(out, expected) <= 1e-4 * expected.abs().max().item()
