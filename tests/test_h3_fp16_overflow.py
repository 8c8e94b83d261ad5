"""h3_fp16_overflow on ComfyUI's own H3 DiT: a tiny model whose activations leave fp16's range where the real
model's do (the magnitude table, printed), stock in fp16 against the pack (red: non-finite; green: as close to fp32
as the bf16 path or closer), bit for bit stock in bf16 and fp32, the branch rescale exact, the attachment through
ComfyUI's ModelPatcher, and the loader's dtype choice under ComfyUI's own rules for each kind of device.
The kernel's exactness alone (no ComfyUI) is tested with generated inputs at the end."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from hotfix_testing.h3_forms import dit_call, inputs_in
from minimax_hotfix.contract import remove_handles
from minimax_hotfix.kernels.h3_fp16 import (
    BRANCH_RESCALE,
    FP16_MAX,
    branches_rescaled,
    divide_projection_input,
    divide_up_half,
    tiny_h3_inputs,
    tiny_h3_model,
    tiny_h3_outputs,
)

CORES = ("0.33.0", "0.39 era")


@pytest.fixture
def h3(comfyui):
    import comfy.ops

    from minimax_hotfix.patches import h3_fp16_overflow

    model_class = h3_fp16_overflow.h3_model_class()
    assert model_class, "this core has no H3 DiT"

    def build(dtype, overflow=True):
        return tiny_h3_model(model_class, comfy.ops.disable_weight_init, dtype, overflow)

    return types.SimpleNamespace(build=build, fix=h3_fp16_overflow.FIX, module=h3_fp16_overflow)


def outputs(h3, dtype, fixed, overflow=True, preprocessed=False):
    """The tiny H3's outputs in ``dtype``, with the fix's hooks (``fixed``) or without; ``preprocessed``: the text
    states go through ``preprocess_text_embeds`` first, as ComfyUI's ``extra_conds`` sends them."""
    model = h3.build(dtype, overflow)
    handles = h3.module.hook_dit(model, h3.fix) if fixed else []
    try:
        if not preprocessed:
            return tiny_h3_outputs(model, dtype)
        inputs = tiny_h3_inputs(dtype)
        with torch.no_grad():
            inputs["context"] = model.preprocess_text_embeds(inputs["context"])
            return torch.cat([part.reshape(-1).float() for part in model(**inputs)])
    finally:
        remove_handles(handles)


def magnitudes(model) -> dict[str, list[float]]:
    """The largest magnitude, fp32 run, at each overflow site: condition_proj's output, the stream after each block,
    each block's out_proj and fc2 outputs."""
    seen = {"condition_proj": [], "stream": [], "out_proj": [], "fc2": []}
    record = lambda name: lambda module, args, output: seen[name].append(output.abs().max().item())  # noqa: E731
    handles = [model.condition_proj.register_forward_hook(record("condition_proj"))]
    for block in model.blocks:
        handles += [block.register_forward_hook(record("stream")),
                    block.attn.out_proj.register_forward_hook(record("out_proj")),
                    block.mlp.fc2.register_forward_hook(record("fc2"))]
    try:
        tiny_h3_outputs(model, torch.float32)
    finally:
        remove_handles(handles)
    return seen


@pytest.mark.cores(*CORES)
def test_the_tiny_h3_overflows_where_the_real_model_does(h3):
    over, within = magnitudes(h3.build(torch.float32)), magnitudes(h3.build(torch.float32, overflow=False))
    print(f"\nlargest magnitude per site, fp32 run (fp16 max {FP16_MAX:.0f})")
    print(f"{'site':<16}{'overflowing variant':>44}  {'in-range variant':>40}")
    for site in over:
        print(f"{site:<16}{' '.join(f'{v:>10.4g}' for v in over[site]):>44}  "
              f"{' '.join(f'{v:>9.3g}' for v in within[site]):>40}")
    stream = over["stream"]
    assert over["condition_proj"][0] > FP16_MAX
    assert stream[0] > FP16_MAX and stream[-1] / stream[0] > 10  # past the range after block 0, growing tens of times
    assert max(over["fc2"]) > FP16_MAX and max(over["out_proj"]) > FP16_MAX
    assert max(max(values) for values in within.values()) < FP16_MAX


@pytest.mark.fails_switched_off("h3_fp16_overflow", "not finite", cores=CORES)
@pytest.mark.parametrize("preprocessed", [False, True], ids=["text states in forward", "extra_conds path"])
def test_in_fp16_the_pack_is_finite_and_as_close_to_fp32_as_bf16(h3, fresh_detection, preprocessed):
    from minimax_hotfix import registry

    needed = registry.status(h3.fix).state.value == "needed"  # the off switch (the red control) reads "disabled"
    reference = outputs(h3, torch.float32, fixed=False, preprocessed=preprocessed)
    stock = outputs(h3, torch.float16, fixed=False, preprocessed=preprocessed)
    pack = outputs(h3, torch.float16, fixed=needed, preprocessed=preprocessed)
    bf16 = outputs(h3, torch.bfloat16, fixed=False, preprocessed=preprocessed)
    pack_error, bf16_error = ((pack - reference).abs().max().item(), (bf16 - reference).abs().max().item())
    print(f"\n{'run':<12}{'finite':>8}{'max |diff| from fp32':>24}")
    for name, out, error in (("stock fp16", stock, None), ("pack fp16", pack, pack_error),
                             ("stock bf16", bf16, bf16_error)):
        finite = bool(torch.isfinite(out).all())
        print(f"{name:<12}{str(finite):>8}{'' if not finite else f'{error:.3g}':>24}")
    assert not torch.isfinite(stock).all()  # the users' black video and NaN audio
    assert torch.isfinite(pack).all(), "the pack's fp16 output is not finite"
    assert pack_error <= bf16_error


@pytest.mark.cores(*CORES)
def test_in_range_the_pack_equals_stock_fp16_within_fp16_rounding(h3):
    reference = outputs(h3, torch.float32, fixed=False, overflow=False)
    stock = outputs(h3, torch.float16, fixed=False, overflow=False)
    pack = outputs(h3, torch.float16, fixed=True, overflow=False)
    scale = reference.abs().max().item()
    print(f"\nin range: |pack - stock| {(pack - stock).abs().max().item():.3g}, |stock - fp32| "
          f"{(stock - reference).abs().max().item():.3g}, |pack - fp32| {(pack - reference).abs().max().item():.3g}"
          f" (outputs up to {scale:.3g})")
    # the pack's only differences are its fp32 residual and fp32 condition_proj: a few fp16 ulps of the output, and
    # as close to fp32 as stock within one ulp (which of the two is closer depends on the environment's fp16 kernels:
    # pack 0.0049 against stock 0.0058 in one, 0.00587 against 0.00583 in another)
    assert torch.allclose(pack, stock, rtol=0, atol=4 * scale * 2.0 ** -10)
    assert (pack - reference).abs().max() <= (stock - reference).abs().max() + scale * 2.0 ** -10


@pytest.mark.cores(*CORES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("overflow", [True, False], ids=["overflowing", "in range"])
def test_in_bf16_and_fp32_the_pack_is_bit_for_bit_stock(h3, dtype, overflow):
    assert torch.equal(outputs(h3, dtype, fixed=True, overflow=overflow),
                       outputs(h3, dtype, fixed=False, overflow=overflow))


@pytest.mark.cores(*CORES)
def test_the_detection_builds_its_tiny_h3_under_dynamic_vram(h3, monkeypatch):
    """Under dynamic VRAM (ComfyUI's default on NVIDIA) ComfyUI's layers are built without weights: the tiny H3 still
    declares and loads every weight, so the fix reads "needed" there too (it read "failed" before)."""
    import comfy.memory_management
    import comfy.ops

    from minimax_hotfix.contract import State
    from minimax_hotfix.kernels.h3_fp16 import TINY_H3

    monkeypatch.setattr(comfy.memory_management, "aimdo_enabled", True)
    with torch.device("meta"):
        lazy = h3.module.h3_model_class()(**TINY_H3, dtype=torch.float16, operations=comfy.ops.disable_weight_init)
    assert lazy.condition_proj.weight is None  # red control: what dynamic VRAM builds
    assert h3.fix.detect().state is State.NEEDED
    assert h3.build(torch.float16).condition_proj.weight.dtype == torch.float16


@pytest.mark.cores(*CORES)
def test_the_fix_attaches_through_comfyuis_model_patcher_and_leaves_a_stock_model_alone(h3, registry):
    import comfy.model_management as mm
    import comfy.model_patcher

    from minimax_hotfix import registry as pack_registry
    from minimax_hotfix.contract import Target

    registry(h3.fix)
    cpu = torch.device("cpu")
    wrapped = [types.SimpleNamespace(diffusion_model=h3.build(torch.float16)) for _ in range(2)]
    for model in wrapped:
        model.get_dtype_inference = lambda: torch.float16
    patchers = [comfy.model_patcher.ModelPatcher(torch.nn.Module(), load_device=cpu, offload_device=cpu)
                for _ in wrapped]
    for patcher, model in zip(patchers, wrapped, strict=True):
        patcher.model.diffusion_model = model.diffusion_model
    assert pack_registry.attach_fixes(patchers[0], Target.MODEL) == [h3.fix.id]
    mm.load_models_gpu(patchers, force_full_load=True)
    try:
        fixed, stock = (tiny_h3_outputs(patcher.model.diffusion_model, torch.float16) for patcher in patchers)
    finally:
        mm.unload_all_models()
    assert torch.isfinite(fixed).all() and not torch.isfinite(stock).all()
    assert "forward" not in vars(patchers[0].model.diffusion_model.blocks[0])  # ejected with the unload


# ComfyUI's own should_use_fp16 / should_use_bf16 on each kind of device, its hardware queries answered as that device
# would: name, compute capability (NVIDIA) or architecture (AMD), bf16 support, OS
DEVICES = {
    "V100 (7.0)": ("cuda", dict(name="Tesla V100-SXM2-16GB", major=7, minor=0), False, "linux", True),
    "T4 (7.5)": ("cuda", dict(name="Tesla T4", major=7, minor=5), False, "linux", True),
    "RTX 2070 (7.5), Windows": ("cuda", dict(name="NVIDIA GeForce RTX 2070", major=7, minor=5), False, "windows",
                                True),
    "GTX 1080 (6.1), Windows": ("cuda", dict(name="NVIDIA GeForce GTX 1080", major=6, minor=1), False, "windows",
                                False),
    "GTX 1660 (7.5)": ("cuda", dict(name="NVIDIA GeForce GTX 1660 SUPER", major=7, minor=5), False, "linux", False),
    "RTX 4090 (8.9)": ("cuda", dict(name="NVIDIA GeForce RTX 4090", major=8, minor=9), True, "linux", False),
    "RX 6800 (RDNA2)": ("hip", dict(name="AMD Radeon RX 6800", major=10, minor=3, gcnArchName="gfx1030"), False,
                        "linux", True),
    "Mac, macOS 13": ("mps", None, False, "macos 13", True),
    "Mac, macOS 14": ("mps", None, True, "macos 14", False),
}


@pytest.mark.parametrize("device_kind", DEVICES)
def test_the_loader_picks_fp16_only_where_comfyui_would_fall_back_to_fp32_and_fp16_is_fast(
        comfyui, monkeypatch, device_kind):
    import comfy.model_management as mm
    from comfy.cli_args import args

    from minimax_hotfix.patches.h3_fp16_overflow import fp16_instead_of_fp32

    backend, props, bf16, system, wanted = DEVICES[device_kind]
    monkeypatch.setattr(mm, "WINDOWS", system == "windows")
    if backend == "mps":
        device = torch.device("mps")
        monkeypatch.setattr(mm, "mac_version", lambda: (int(system.split()[1]),))
    else:
        device = torch.device("cuda", 0)
        monkeypatch.setattr(mm, "cpu_state", mm.CPUState.GPU)
        monkeypatch.setattr(torch.version, "cuda", None if backend == "hip" else "12.4")
        monkeypatch.setattr(torch.version, "hip", "6.2" if backend == "hip" else None)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(**props))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (props["major"], props["minor"]))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    print(f"\n{device_kind}: should_use_fp16 {mm.should_use_fp16(device)}, should_use_bf16 "
          f"{mm.should_use_bf16(device)}, H3 in fp16 with the pack's loader: {fp16_instead_of_fp32(device)}")
    assert mm.should_use_bf16(device) == bf16 or backend == "hip"  # RDNA2: bf16 only by manual cast
    assert fp16_instead_of_fp32(device) is wanted
    monkeypatch.setattr(args, "fp32_unet", True)  # the user's choice stands
    assert fp16_instead_of_fp32(device) is False


# Reading a tensor back to the host: on a GPU each waits for the device (a synchronization)
HOST_READS = frozenset({torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist, torch.Tensor.__float__,
                        torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy})


class HostReads(TorchFunctionMode):
    """Counts the host reads of the torch calls made inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in HOST_READS
        return func(*args, **(kwargs or {}))


def cast_model(h3, layers: int = 4, sink_growth: float = 3.0):
    """The tiny H3 as ComfyUI loads it on a device without bf16: weights kept in fp32, each cast to the call's
    dtype (``comfy.ops.manual_cast``), so that an fp16 call and its fp32 run share every weight."""
    import comfy.ops

    model_class = h3.module.h3_model_class()
    return tiny_h3_model(model_class, comfy.ops.manual_cast, torch.float32, overflow=True,
                         config={"num_layers": layers}, sink_growth=sink_growth)


@pytest.fixture
def net(h3, monkeypatch):
    """A fresh safety-net record on the fix."""
    monkeypatch.setattr(h3.fix, "net", h3.module.SafetyNet())
    return h3.fix.net


def as_comfyui_calls(model, inputs: dict) -> torch.Tensor:
    """One DiT call as ComfyUI's model makes it (``model_base._apply_model``): the latents and the timestep
    positional, the rest by keyword."""
    rest = {key: value for key, value in inputs.items() if key not in ("x", "timestep")}
    with torch.no_grad():
        return torch.cat([part.reshape(-1).to(torch.float32) for part in model(inputs["x"], inputs["timestep"], **rest)])


@pytest.mark.cores(*CORES)
@pytest.mark.parametrize("call", [dit_call, as_comfyui_calls], ids=["by keyword", "as ComfyUI calls it"])
def test_past_the_rescale_the_safety_net_runs_the_call_again_in_fp32(h3, net, caplog, call):
    """fc2 above 256 x 65504: even rescaled it overflows fp16. Red control: the fix without its net gives NaN, with
    no word in the log. With the net: the call's output equals its fp32 run bit for bit, and the log says so once
    for the prompt however many calls trip; whether the inputs come positionally or by keyword."""
    model = cast_model(h3, sink_growth=7.0)
    fc2 = magnitudes(model)["fc2"]
    assert max(fc2) > BRANCH_RESCALE * FP16_MAX, fc2
    inputs = inputs_in(torch.float16)
    reference = dit_call(model, inputs_in(torch.float32))  # the fp16 call's own inputs, widened
    runs = {}
    for with_net in (False, True):
        handles = h3.module.hook_dit(model, h3.fix, net=with_net)
        try:
            runs[with_net] = [call(model, inputs) for _ in range(2)]
        finally:
            remove_handles(handles)
    print(f"\nfc2 peak {max(fc2):.3g} (the rescale's envelope {BRANCH_RESCALE * FP16_MAX:.3g}); without the net "
          f"finite: {bool(torch.isfinite(runs[False][0]).all())}; with it |diff| from the fp32 run "
          f"{(runs[True][0] - reference).abs().max().item():.3g}; {net.summary()}")
    assert not torch.isfinite(runs[False][0]).all()
    assert all(torch.equal(out, reference) for out in runs[True])
    trips = [record for record in caplog.records if "left float16's range" in record.getMessage()]
    assert len(trips) == 1 and "ran again in float32" in trips[0].getMessage()
    assert net.summary() == "safety net: tripped in the last run: 2 of 2 DiT call(s) ran again in float32"


@pytest.mark.cores(*CORES)
@pytest.mark.parametrize("layers, sink_growth", [(4, 3.0), (8, 2.0)], ids=["4 blocks", "8 blocks"])
def test_inside_the_envelope_the_net_never_trips_and_reads_the_device_once_per_call(h3, net, layers, sink_growth):
    """The net costs one host read per DiT call, however many blocks (no block adds one), and inside the rescale's
    envelope it recomputes nothing: the output is the fix's without the net, bit for bit."""
    model = cast_model(h3, layers, sink_growth)
    assert max(magnitudes(model)["fc2"]) < BRANCH_RESCALE * FP16_MAX
    reads, outs = {}, {}
    for with_net in (False, True):
        handles = h3.module.hook_dit(model, h3.fix, net=with_net)
        try:
            with HostReads() as counted:
                outs[with_net] = dit_call(model, inputs_in(torch.float16))
        finally:
            remove_handles(handles)
        reads[with_net] = counted.count
    print(f"\n{layers} blocks: host reads per DiT call {reads[False]} without the net, {reads[True]} with it; "
          f"{net.summary()}")
    assert reads[True] == reads[False] + 1
    assert torch.equal(outs[True], outs[False]) and torch.isfinite(outs[True]).all()
    assert net.summary() == "safety net: did not trip in the last run (1 float16 DiT call(s) checked)"


@pytest.mark.cores(*CORES)
def test_audio_rows_as_attention_sinks_need_no_fp32_attention(h3):
    """A public V100 patch keeps H3's attention over the target and reference audio rows in fp32. Here every audio
    row is a sink from the first block on (``audio_patch_proj``'s channel 0 biased, so each block's MLP grows it as
    the text sink grows: about 1e5 after block 1, 4.4e6 after block 4), and the fix's fp16 attention is as close to
    fp32 as with the text sink alone and closer than bf16: q and k are RMS-normalized per head (``q_norm``,
    ``k_norm``) and v comes from the normalized stream, so what attention reads stays in range however large the
    stream's rows grow; the stream itself is fp32."""
    from comfy.ldm.minimax.model import PackedLayout

    inputs = inputs_in(torch.float16)
    video, audio = inputs["x"]
    layout = PackedLayout(inputs["context"].shape[1], video.shape[2], video.shape[3], video.shape[4], audio.shape[-1])
    first, last, _ = next(segment for segment in layout.segments if segment[2] == "audio")
    errors = {}
    for audio_sink in (False, True):
        model = cast_model(h3)
        if audio_sink:
            with torch.no_grad():
                model.audio_patch_proj.bias[0] = 3000.0
        audio_rows = []
        handles = [block.register_forward_hook(
            lambda module, args, output, rows=audio_rows: rows.append(output[first:last, 0].abs().min().item()))
            for block in model.blocks]
        reference = dit_call(model, inputs_in(torch.float32))
        remove_handles(handles)
        bf16 = dit_call(model, inputs_in(torch.bfloat16))
        fixed = h3.module.hook_dit(model, h3.fix, net=False)
        try:
            pack = dit_call(model, inputs)
        finally:
            remove_handles(fixed)
        errors[audio_sink] = ((pack - reference).abs().max().item(), (bf16 - reference).abs().max().item())
        print(f"\naudio rows as sinks: {audio_sink}; smallest audio row's channel 0 after each block "
              f"{', '.join(f'{value:.3g}' for value in audio_rows)}; |pack fp16 - fp32| {errors[audio_sink][0]:.3g}, "
              f"|bf16 - fp32| {errors[audio_sink][1]:.3g}")
        if audio_sink:
            assert audio_rows[0] > FP16_MAX  # every audio row past fp16's range from the first block on
    pack_error, bf16_error = errors[True]
    assert pack_error <= bf16_error and pack_error <= 1.1 * errors[False][0]


class Fp32Model(torch.nn.Module):
    """What ComfyUI's BaseModel gives the dtype choice: its diffusion model, weight dtype and cast dtype."""

    def __init__(self, diffusion_model):
        super().__init__()
        self.diffusion_model, self.manual_cast_dtype = diffusion_model, None

    def get_dtype(self):
        return torch.float32


@pytest.mark.cores(*CORES)
def test_the_dtype_choice_goes_on_the_patcher_it_is_given_and_never_on_the_one_that_was_cloned(h3, monkeypatch):
    """The pack's loader chooses on its own patcher, the Apply node on its clone (nodes/__init__.py): the patcher an
    upstream loader caches keeps ComfyUI's float32, as a stock run after the Apply node is deleted needs. A patcher
    that already computes in another dtype (a ModelComputeDtype node upstream of the Apply node) keeps it."""
    import comfy.model_management as mm
    import comfy.model_patcher

    cached = comfy.model_patcher.ModelPatcher(Fp32Model(h3.build(torch.float32)), load_device=torch.device("cpu"),
                                              offload_device=torch.device("cpu"))
    monkeypatch.setattr(mm, "should_use_bf16", lambda *a, **k: True)
    assert not h3.module.choose_fp16(cached.clone())  # a bf16 device: ComfyUI's own choice stands
    monkeypatch.setattr(mm, "should_use_bf16", lambda *a, **k: False)
    monkeypatch.setattr(mm, "should_use_fp16", lambda *a, **k: True)
    own = cached.clone()
    assert h3.module.choose_fp16(own)
    assert own.object_patches["manual_cast_dtype"] is torch.float16 and own.force_cast_weights
    assert "manual_cast_dtype" not in cached.object_patches and not cached.force_cast_weights
    assert h3.module.compute_dtype(cached) == torch.float32 and h3.module.compute_dtype(own) == torch.float16
    chosen_upstream = cached.clone()
    chosen_upstream.set_model_compute_dtype(torch.bfloat16)
    assert not h3.module.choose_fp16(chosen_upstream.clone())


def test_the_branch_hooks_act_only_inside_a_rescaled_branch():
    linear, fc1 = torch.nn.Linear(8, 4, bias=False).half(), torch.nn.Linear(8, 8, bias=False).half()
    linear.register_forward_pre_hook(divide_projection_input)
    fc1.register_forward_hook(divide_up_half)
    x = torch.ones(2, 8, dtype=torch.float16)
    plain_projection, plain_fc1 = linear(x), fc1(x)
    with branches_rescaled():
        assert torch.equal(linear(x) * BRANCH_RESCALE, plain_projection)
        scaled = fc1(x)
    assert torch.equal(scaled[:, :4], plain_fc1[:, :4]) and torch.equal(scaled[:, 4:] * BRANCH_RESCALE, plain_fc1[:, 4:])


# inputs and products that stay normal fp16 numbers after the division (silu(gate) >= 0.73 for gate >= 1)
NORMAL_FP16 = st.floats(min_value=BRANCH_RESCALE * 2.0 ** -13, max_value=60.0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(values=st.lists(st.tuples(NORMAL_FP16, st.booleans()), min_size=16, max_size=16),
       seed=st.integers(0, 2 ** 16))
def test_the_branch_rescale_is_bit_exact_for_inputs_that_stay_normal(values, seed):
    x = torch.tensor([value if positive else -value for value, positive in values]).view(2, 8).half()
    weight = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed)).half()
    direct = torch.nn.functional.linear(x, weight)
    gate, up = (torch.rand(2, 8, generator=torch.Generator().manual_seed(seed + 1)) * 2 + 1).half(), x
    swiglu = torch.nn.functional.silu(gate) * up
    assert torch.equal(torch.nn.functional.linear(x / BRANCH_RESCALE, weight) * BRANCH_RESCALE, direct)
    assert torch.equal((torch.nn.functional.silu(gate) * (up / BRANCH_RESCALE)) * BRANCH_RESCALE, swiglu)


def test_the_startup_note_and_the_status_table_say_which_dtype_each_loader_path_computes_in(h3, net, monkeypatch):
    import comfy.model_management as mm
    from comfy.cli_args import args

    from minimax_hotfix.patches.h3_fp16_overflow import machine_note
    from minimax_hotfix.registry.status_table import status_table

    assert machine_note() is None  # red control: a CPU run, no flag: nothing to say at start-up
    assert "MiniMax H3 computes in float32 on cpu through every loader" in status_table(fixes=[h3.fix])
    monkeypatch.setattr(mm, "get_torch_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(mm, "should_use_fp16", lambda *a, **k: True)
    monkeypatch.setattr(mm, "should_use_bf16", lambda *a, **k: False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    note = machine_note()
    print(f"\nno bf16: {note}")
    assert "in float32 through the stock loaders (no bfloat16 here" in note
    assert "in float16 through the pack's loader, the Apply node and server-side fixing" in note
    table = status_table(width=400, fixes=[h3.fix])
    print(table.split("\n\n")[-2])
    assert note in table and net.summary() in table  # the Status node's "on this machine" rows, as the doctor's
    monkeypatch.setattr(args, "fp16_unet", True)
    note = machine_note()
    print(f"--fp16-unet: {note}")
    assert "in float16 through the stock loaders (video black, audio NaN)" in note


@pytest.fixture
def benchmark(comfyui):
    from minimax_hotfix.benchmarks import h3_fp16_overflow  # benchmarks/, reached through the pack's folder

    return h3_fp16_overflow


BENCHMARK_ARGS = ["--tiny", "--tokens", "64", "--rounds", "1", "--overhead-target", "100",
                  "--net-overhead-target", "100"]  # checks, not timings


def test_the_benchmark_checks_that_the_fix_ran(benchmark, tmp_path, monkeypatch, capsys):
    """The benchmark's own checks on the tiny H3: finite in every mode and the pack's run on the fp32-stream path;
    red control: with no hooks attached the pack's run is plain fp16 and the benchmark says so (exit 1)."""
    figures = tmp_path / "figures.json"
    assert benchmark.main([*BENCHMARK_ARGS, "--json", str(figures)]) == 0, capsys.readouterr().out
    measured = json.loads(figures.read_text())
    assert measured["finite"] and measured["fp32_stream_ran"]
    assert set(measured["ms_per_step"]) == {"fp32", "fp16", "pack", "no_net"} and measured["net_recomputed_nothing"]
    assert measured["weight_bytes"]["fp32"] > measured["weight_bytes"]["fp16"]
    monkeypatch.setattr(benchmark, "hook_dit", lambda model, fix, net: [])
    assert benchmark.main(BENCHMARK_ARGS) == 1
    assert "did NOT take the fp32-stream path" in capsys.readouterr().out


def test_the_benchmark_is_part_of_the_gpu_check():
    source = (Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py").read_text()
    assert 'benchmark_part("h3_fp16_overflow"' in source
