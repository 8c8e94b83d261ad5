"""Self-test of music3_graph_capture: a tiny Llama-shaped decoder with one GGUF-style Q4_0 layer. CPU: capture rules
emulated on ``meta`` tensors (the red control on every machine: a real failed capture can abort the process). CUDA:
real graphs with the policy, equal to graphs off."""

from __future__ import annotations

import torch

from ...contract import Check
from ...kernels.music3_graph_capture import decide_unit
from ..devices import real_accelerator
from ..emulated_capture import CAPTURE_HOST_COPY_ERROR, capture_allowed_on
from ..tiny_decoder import (
    SMALL_CONFIG,
    CudaGraphs,
    EmulatedGraphs,
    GGUFStyleQ4Linear,
    build_decoder,
    decode_hidden_states,
    quantize_q4_0,
)

SELF_TEST_STEPS = 6
GGUF_LAYER = 1


def self_test():
    with torch.no_grad():
        yield from emulated_checks()
        device = real_accelerator()
        if device is not None and device.type == "cuda":
            yield cuda_check(device)


def emulated_checks():
    meta = torch.device("meta")
    model = build_decoder(SMALL_CONFIG, meta, q4_layers=(GGUF_LAYER,))
    try:
        decode_hidden_states(model, SELF_TEST_STEPS, runner=EmulatedGraphs(capture_rules=True), device=meta)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    yield Check("red: capturing every unit hits the Q4_0 layer's host copy (emulated capture)",
                error == CAPTURE_HOST_COPY_ERROR, error or "no error")
    runner = EmulatedGraphs(capture_allowed=capture_allowed_on(meta), capture_rules=True)
    decode_hidden_states(model, SELF_TEST_STEPS, runner=runner, device=meta)
    refused = [index for index, layer in enumerate(model.layers) if layer in runner.refused]
    yield Check("green: only the Q4_0 unit runs uncaptured, the others keep their graphs",
                refused == [GGUF_LAYER] and len(runner.graphs) == SMALL_CONFIG.layers - 1,
                f"uncaptured layers {refused}, captured {len(runner.graphs)}")
    weight = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    yield Check("green: the policy names the reason", "GGUF Q4_0" in decide_unit(
        [GGUFStyleQ4Linear(quantize_q4_0(weight), weight.shape)], meta).reason)


def cuda_check(device):
    model = build_decoder(SMALL_CONFIG, device, q4_layers=(GGUF_LAYER,))
    reference = decode_hidden_states(model, SELF_TEST_STEPS, device=device)
    runner = CudaGraphs(device, capture_allowed=capture_allowed_on(device))
    graphed = decode_hidden_states(model, SELF_TEST_STEPS, runner=runner, static_buffers=True, device=device)
    diff = (graphed - reference).abs().max().item()
    return Check("green: real CUDA graphs with the policy equal graphs off", diff == 0 and len(runner.graphs) ==
                 SMALL_CONFIG.layers - 1, f"max abs diff {diff:.3g}, captured {len(runner.graphs)} units")
