"""music3_graph_buffers on CPU: the static buffer pool keeps addresses across decode steps and reallocates only on a
new key; a Llama-shaped decoder decoded like Music 3's AR loop under per-layer graph replay (the CPU stand-in reads
the tensors bound at capture, as a CUDA graph reads captured addresses) is noise without the pooled decode buffers
(red) and equal to graphs off with them (green). The ComfyUI half is in test_music3_graphs_comfyui.py."""

import pytest
import torch

from hotfix_testing.music3_support import check_not_applicable_without_comfyui, check_self_test_red_then_green
from minimax_hotfix.diagnostics.tiny_decoder import (
    EmulatedGraphs,
    TinyCache,
    TinyConfig,
    build_decoder,
    decode_hidden_states,
)
from minimax_hotfix.kernels.music3_graph_buffers import (
    StaticBufferPool,
    is_graphed_decode_step,
    tensor_key,
    with_decode_buffers,
)
from minimax_hotfix.patches.music3_graph_buffers import FIX

CONFIG = TinyConfig(hidden=64, heads=4, layers=3, intermediate=128, capacity=24, vocab=64)
STEPS = 12


# --- the pool -------------------------------------------------------------------------------------------------------

def test_pool_keeps_data_ptr_across_steps():
    pool, allocations = StaticBufferPool(), []

    def allocate():
        allocations.append(torch.empty(2, 1, 8))
        return allocations[-1]

    pointers = {pool.reserve("decode", tensor_key(torch.randn(2, 1, 8)), allocate).data_ptr() for _ in range(10)}
    assert len(pointers) == 1 and len(allocations) == 1


@pytest.mark.parametrize("changed", [
    lambda t: t[:1],  # shape
    lambda t: torch.empty_strided(t.shape, (8, 16, 1)),  # stride only
    lambda t: t.to(torch.float16),  # dtype
    lambda t: t.to("meta"),  # device
], ids=["shape", "stride", "dtype", "device"])
def test_pool_reallocates_on_a_new_key_then_keeps_the_new_buffer(changed):
    pool, step = StaticBufferPool(), torch.randn(2, 1, 8)
    first = pool.reserve("decode", tensor_key(step), lambda: torch.empty_like(step))
    other = changed(step)
    second = pool.reserve("decode", tensor_key(other), lambda: torch.empty_like(other))
    assert second is not first
    assert pool.reserve("decode", tensor_key(other), lambda: pytest.fail("reallocated for the same key")) is second


def test_pool_names_are_independent():
    pool = StaticBufferPool()
    a = pool.reserve("a", 1, lambda: torch.zeros(1))
    b = pool.reserve("b", 1, lambda: torch.zeros(1))
    assert a is not b and pool.reserve("a", 1, lambda: None) is a


# --- the forward wrapper -------------------------------------------------------------------------------------------

def recorded_forward(model):
    seen = []

    def forward(*args, decode_buffers=None, **kwargs):
        seen.append(decode_buffers)
        return type(model).forward(model, *args, decode_buffers=decode_buffers, **kwargs)

    return forward, seen


def decode_steps(model, forward, steps=4):
    cache = TinyCache(CONFIG, 2, "cpu", torch.float32)
    for _ in range(steps):
        forward(None, embeds=torch.randn(2, 1, CONFIG.hidden), past_key_values=cache)


def test_decode_steps_get_one_stable_buffer_pair_prefill_gets_none():
    model = build_decoder(CONFIG, "cpu")
    forward, seen = recorded_forward(model)
    with torch.no_grad():
        decode_steps(model, with_decode_buffers(model, forward, StaticBufferPool(), lambda: False))
    assert seen[0] is not None  # graphed decoders pass buffers on every single-token step with a cache
    assert len({id(buffers) for buffers in seen}) == 1
    assert len({buffers[0].data_ptr() for buffers in seen}) == 1


def test_buffers_only_for_graphed_single_token_steps_with_a_cache():
    model = build_decoder(CONFIG, "cpu")
    cache, token = TinyCache(CONFIG, 2, "cpu", torch.float32), torch.randn(2, 1, CONFIG.hidden)
    assert is_graphed_decode_step(model, token, cache)
    assert not is_graphed_decode_step(model, torch.randn(2, 5, CONFIG.hidden), cache)  # prefill
    assert not is_graphed_decode_step(model, token, None) and not is_graphed_decode_step(model, token, [])
    model.graph_dynamic_vbar_blocks = False  # a decoder that never graphs
    forward, seen = recorded_forward(model)
    with torch.no_grad():
        with_decode_buffers(model, forward, StaticBufferPool(), lambda: False)(None, embeds=token,
                                                                              past_key_values=cache)
    assert seen == [None]


def test_disable_cuda_graphs_and_callers_own_buffers_pass_through():
    model = build_decoder(CONFIG, "cpu")
    forward, seen = recorded_forward(model)
    with torch.no_grad():
        decode_steps(model, with_decode_buffers(model, forward, StaticBufferPool(), lambda: True), steps=2)
        own = model.init_decode_buffers(2, "cpu", torch.float32)
        wrapped = with_decode_buffers(model, forward, StaticBufferPool(), lambda: False)
        wrapped(None, embeds=torch.randn(2, 1, CONFIG.hidden), past_key_values=TinyCache(CONFIG, 2, "cpu",
                torch.float32), decode_buffers=own)
    assert seen == [None, None, own]


# --- red / green on the decode loop -------------------------------------------------------------------------------

def test_red_graph_replay_without_static_buffers_is_noise():
    model = build_decoder(CONFIG, "cpu")
    with torch.no_grad():
        reference = decode_hidden_states(model, STEPS)
        graphed = decode_hidden_states(model, STEPS, runner=EmulatedGraphs())
    assert (graphed - reference).abs().max() > 0.1


def test_green_graph_replay_with_pooled_buffers_equals_graphs_off():
    model = build_decoder(CONFIG, "cpu")
    runner = EmulatedGraphs()
    with torch.no_grad():
        reference = decode_hidden_states(model, STEPS)
        graphed = decode_hidden_states(model, STEPS, runner=runner, static_buffers=True)
    assert len(runner.graphs) == CONFIG.layers  # graphs stayed on
    assert torch.equal(graphed, reference)


# --- the fix object -------------------------------------------------------------------------------------------------

def test_without_comfyui_the_fix_is_not_applicable():
    check_not_applicable_without_comfyui(FIX)


def test_install_leaves_other_models_alone():
    model = build_decoder(CONFIG, "cpu")
    assert FIX.hook_loaded_model(model) == [] and "forward" not in vars(model)


def test_self_test_passes_on_cpu():
    check_self_test_red_then_green(FIX)
