"""music3_graph_capture on CPU: the capture policy decides per unit from weight type (real GGUF Q4_0 tensors written
and read with the ``gguf`` package) and residency, and a decoder run under emulated capture rules fails without it
(red) and keeps every other unit's graph with it (green). The ComfyUI half is in test_music3_graphs_comfyui.py."""

import pytest
import torch

from hotfix_testing.ggml_layout import GGMLLayoutParams, ggml_layout_tensor
from hotfix_testing.music3_support import (
    GGMLTensor,
    check_not_applicable_without_comfyui,
    check_self_test_red_then_green,
    write_and_read_gguf,
)
from minimax_hotfix.diagnostics.emulated_capture import CAPTURE_HOST_COPY_ERROR, capture_allowed_on, emulated_capture
from minimax_hotfix.diagnostics.tiny_decoder import (
    EmulatedGraphs,
    HostWeightLinear,
    TinyConfig,
    build_decoder,
    decode_hidden_states,
    dequantize_q4_0,
    quantize_q4_0,
)
from minimax_hotfix.kernels.music3_graph_capture import decide_unit, ggml_type
from minimax_hotfix.patches.music3_graph_capture import FIX

gguf = pytest.importorskip("gguf")

CONFIG = TinyConfig(hidden=64, heads=4, layers=3, intermediate=128, capacity=16, vocab=64)
STEPS = 6
GGUF_LAYER = 1
CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it


@pytest.fixture(scope="module")
def q4_0(tmp_path_factory):
    torch.manual_seed(0)
    weight = torch.randn(CONFIG.hidden, CONFIG.intermediate)
    raw, shape, tensor_type = write_and_read_gguf(tmp_path_factory.mktemp("gguf") / "down.gguf",
                                                  {"blk.1.ffn_down.weight": weight}, gguf.GGMLQuantizationType.Q4_0)[
        "blk.1.ffn_down.weight"]
    assert tensor_type == gguf.GGMLQuantizationType.Q4_0 and shape == tuple(weight.shape)
    return weight, raw, shape


def linear_with(weight) -> torch.nn.Module:
    layer = torch.nn.Linear(1, 1, bias=False)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return layer


# --- the Q4_0 stand-in of the harness is the real format ---------------------------------------------------------

def test_harness_q4_0_is_bit_identical_to_gguf(q4_0):
    weight, raw, shape = q4_0
    assert torch.equal(quantize_q4_0(weight), raw.reshape(-1, 18))
    reference = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert torch.equal(dequantize_q4_0(raw.reshape(-1, 18), shape), torch.from_numpy(reference))


# --- the policy: per unit, from type and residency ----------------------------------------------------------------

def test_a_legacy_gguf_q4_0_weight_refuses_capture_its_dequantized_twin_allows_it(q4_0):
    _, raw, shape = q4_0
    gguf_unit = linear_with(GGMLTensor(raw, gguf.GGMLQuantizationType.Q4_0, shape))
    decision = decide_unit([gguf_unit], "cpu")
    assert not decision.capture and "GGUF Q4_0" in decision.reason
    assert decide_unit([linear_with(dequantize_q4_0(raw.reshape(-1, 18), shape))], "cpu").capture


@pytest.mark.skipif(GGMLLayoutParams is None, reason="needs comfy-kitchen")
def test_a_dynamic_vram_gguf_weight_refuses_capture_even_when_streamed(q4_0):
    _, raw, shape = q4_0
    unit = linear_with(ggml_layout_tensor(raw, shape, gguf.GGMLQuantizationType.Q4_0))
    unit._v = ("vbar slot",)  # streamed by the dynamic-VRAM allocator: residency is fine, the type is not
    assert ggml_type(unit.weight) == 2
    decision = decide_unit([unit], CUDA)
    assert not decision.capture and "GGUF Q4_0" in decision.reason


@pytest.mark.skipif(GGMLLayoutParams is None, reason="needs comfy-kitchen")
def test_the_emulated_capture_sees_a_dequantization_inside_a_weights_dispatch(q4_0):
    """ComfyUI's dynamic-VRAM cast leaves a GGUF weight quantized and ``F.linear`` dequantizes it in the weight's
    ``__torch_dispatch__``, where no torch-function mode runs: the emulated rules must see that host copy as CUDA
    does (before they did not, and a GGUF Music 3 server on the emulated graphs captured its Q4_0 layer). The rule
    holds in the capturing thread only, and not after the capture."""
    import threading

    _, raw, shape = q4_0
    weight = ggml_layout_tensor(raw, shape, gguf.GGMLQuantizationType.Q4_0)
    x = torch.randn(2, shape[1], dtype=torch.bfloat16)
    for call in (lambda: torch.nn.functional.linear(x, weight), lambda: x @ weight.t(), weight.dequantize):
        with pytest.raises(RuntimeError, match="during CUDA graph capture"), emulated_capture(host_data_is_copy=True):
            call()
    other_thread = []
    with emulated_capture(host_data_is_copy=True):
        thread = threading.Thread(target=lambda: other_thread.append(torch.nn.functional.linear(x, weight)))
        thread.start()
        thread.join()
    assert other_thread[0].shape == (2, shape[0])
    assert torch.equal(torch.nn.functional.linear(x, weight), other_thread[0])


@pytest.mark.parametrize("type_name, capture", [("F16", True), ("BF16", True), ("Q8_0", True), ("Q4_0", False),
                                                ("Q4_1", False), ("Q5_0", False), ("Q5_1", False)])
def test_gguf_types_with_on_device_dequantization_keep_their_graphs(tmp_path, type_name, capture):
    qtype = gguf.GGMLQuantizationType[type_name]
    torch.manual_seed(0)
    raw, shape, read_type = write_and_read_gguf(tmp_path / "w.gguf", {"w": torch.randn(4, 256)}, qtype)["w"]
    assert decide_unit([linear_with(GGMLTensor(raw, read_type, shape))], "cpu").capture is capture


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "TQ1_0"])
def test_k_and_iq_quants_and_unknown_types_refuse_capture(type_name):
    # the gguf package cannot write these; the policy reads only the type, so the bytes do not matter
    weight = GGMLTensor(torch.zeros(4, 144, dtype=torch.uint8), gguf.GGMLQuantizationType[type_name], (4, 256))
    decision = decide_unit([linear_with(weight)], "cpu")
    assert not decision.capture and "GGUF" in decision.reason


def test_residency_unpinned_host_weights_refuse_capture_unless_streamed_or_on_the_device():
    host_unit = linear_with(torch.randn(4, 4))
    decision = decide_unit([host_unit], CUDA)
    assert not decision.capture and "unpinned host memory" in decision.reason
    assert decide_unit([host_unit], "cpu").capture  # computes where it lives: nothing is copied
    host_unit._v = ("vbar slot",)
    assert decide_unit([host_unit], CUDA).capture  # streamed: the core captures only fully resident blocks


def test_the_decision_is_per_unit(q4_0):
    _, raw, shape = q4_0
    units = [linear_with(torch.randn(4, 4).to("meta")),
             linear_with(GGMLTensor(raw, gguf.GGMLQuantizationType.Q4_0, shape)),
             linear_with(torch.randn(4, 4).to("meta"))]
    assert [decide_unit([unit], "meta").capture for unit in units] == [True, False, True]


# --- a decoder under emulated capture rules: red without the policy, green with it --------------------------------

def test_emulated_capture_rules_are_the_real_ones_shape():
    meta = torch.device("meta")
    with emulated_capture():
        torch.ones(2, device=meta) * 2  # on-device work is fine
        with pytest.raises(RuntimeError, match="unless the CPU tensor is pinned"):
            torch.tensor([0, 4], device=meta)
        with pytest.raises(RuntimeError, match="unless the CPU tensor is pinned"):
            torch.ones(2).to(meta)
    torch.tensor([0, 4], device=meta)  # outside capture: allowed


def test_red_capturing_every_unit_hits_the_q4_0_host_copy():
    meta = torch.device("meta")
    model = build_decoder(CONFIG, meta, q4_layers=(GGUF_LAYER,))
    with torch.no_grad(), pytest.raises(RuntimeError) as failure:
        decode_hidden_states(model, STEPS, runner=EmulatedGraphs(capture_rules=True), device=meta)
    assert str(failure.value) == CAPTURE_HOST_COPY_ERROR


def test_green_only_the_q4_0_unit_runs_uncaptured():
    meta = torch.device("meta")
    model = build_decoder(CONFIG, meta, q4_layers=(GGUF_LAYER,))
    runner = EmulatedGraphs(capture_allowed=capture_allowed_on(meta), capture_rules=True)
    with torch.no_grad():
        decode_hidden_states(model, STEPS, runner=runner, device=meta)
    assert runner.refused == {model.layers[GGUF_LAYER]}
    assert set(runner.graphs) == {layer for i, layer in enumerate(model.layers) if i != GGUF_LAYER}


def test_red_green_host_resident_weight():
    meta = torch.device("meta")
    model = build_decoder(CONFIG, meta)
    model.layers[0].up_proj = HostWeightLinear(torch.randn(CONFIG.intermediate, CONFIG.hidden))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="unless the CPU tensor is pinned"):
            decode_hidden_states(model, STEPS, runner=EmulatedGraphs(capture_rules=True), device=meta)
        runner = EmulatedGraphs(capture_allowed=capture_allowed_on(meta), capture_rules=True)
        decode_hidden_states(model, STEPS, runner=runner, device=meta)
    assert runner.refused == {model.layers[0]} and len(runner.graphs) == CONFIG.layers - 1


def test_green_values_with_the_policy_equal_graphs_off():
    model = build_decoder(CONFIG, "cpu", q4_layers=(GGUF_LAYER,))
    with torch.no_grad():
        reference = decode_hidden_states(model, STEPS)
        graphed = decode_hidden_states(model, STEPS, runner=EmulatedGraphs(capture_allowed=capture_allowed_on("cpu")),
                                       static_buffers=True)
    assert torch.equal(graphed, reference)


# --- the fix object -------------------------------------------------------------------------------------------------

def test_without_comfyui_the_fix_is_not_applicable():
    check_not_applicable_without_comfyui(FIX)


def test_self_test_passes_on_cpu():
    check_self_test_red_then_green(FIX)
