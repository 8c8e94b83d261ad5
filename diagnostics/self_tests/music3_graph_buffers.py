"""Self-test of music3_graph_buffers: a tiny Llama-shaped decoder decoded like Music 3's AR loop, graphs off vs
per-layer graphs: real CUDA graphs on a GPU, otherwise the CPU stand-in whose replays read the tensors bound at
capture."""

from __future__ import annotations

import torch

from ...contract import Check
from ...kernels.music3_graph_buffers import StaticBufferPool, tensor_key
from ..devices import real_accelerator
from ..tiny_decoder import SMALL_CONFIG, CudaGraphs, EmulatedGraphs, build_decoder, decode_hidden_states

SELF_TEST_STEPS = 8


def self_test():
    device = real_accelerator()
    on_cuda = device is not None and device.type == "cuda"
    device = device if on_cuda else torch.device("cpu")
    graphs = (lambda: CudaGraphs(device)) if on_cuda else EmulatedGraphs
    kind = "CUDA graphs" if on_cuda else "emulated graphs (CPU)"
    with torch.no_grad():
        model = build_decoder(SMALL_CONFIG, device)
        reference = decode_hidden_states(model, SELF_TEST_STEPS, device=device)
        stale = decode_hidden_states(model, SELF_TEST_STEPS, runner=graphs(), device=device)
        fixed = decode_hidden_states(model, SELF_TEST_STEPS, runner=graphs(), static_buffers=True, device=device)
    stale_diff = (stale - reference).abs().max().item()
    fixed_diff = (fixed - reference).abs().max().item()
    yield Check(f"red: {kind} without static buffers replay stale addresses", stale_diff > 0,
                f"max abs diff vs graphs off {stale_diff:.3g}")
    yield Check(f"green: {kind} with pooled decode buffers equal graphs off", fixed_diff == 0,
                f"max abs diff {fixed_diff:.3g}")
    yield from pool_checks(device)


def pool_checks(device):
    """Buffer identity across steps and reallocation on a new key."""
    pool = StaticBufferPool()
    step = torch.zeros(2, 1, 8, device=device)
    allocate = lambda: torch.empty_like(step)  # noqa: E731
    first = pool.reserve("decode", tensor_key(step), allocate)
    same = all(pool.reserve("decode", tensor_key(step.clone()), allocate).data_ptr() == first.data_ptr()
               for _ in range(4))
    yield Check("green: a buffer keeps its address across decode steps", same)
    halved = step.to(torch.float16)
    moved = pool.reserve("decode", tensor_key(halved), lambda: torch.empty_like(halved))
    yield Check("green: a new shape/stride/dtype/device key reallocates", moved.dtype == torch.float16
                and moved.data_ptr() != first.data_ptr())
