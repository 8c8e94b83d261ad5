"""A tiny Llama-shaped decoder whose decode steps run the way ComfyUI's Music 3 AR loop runs them, for the
self-tests, the tests and the GPU check of the two Music 3 CUDA-graph fixes. Pure torch.

What it shares with ComfyUI's ``Llama2_`` (post Comfy Compiler #15861): a static KV cache written at a device-side
position, per-layer graph units run through a ``core()`` closure, ``forward(..., decode_buffers=None)`` that clones
the hidden state before graphed steps unless the caller passes static buffers, and ``init_decode_buffers``.

Graph runners (``runner.run(module, core, enable_graph)``, like ``comfy.model_prefetch.prefetch_queue_pop``: warm up
once, capture on the second call, replay afterwards):
* ``CudaGraphs``: real ``torch.cuda.CUDAGraph`` capture and replay;
* ``EmulatedGraphs``: a CPU stand-in whose replay calls the closure captured at capture time, so it reads the
  tensors that were bound then, exactly as a CUDA graph reads the addresses it captured.
Both take ``capture_allowed(module)``, where the capture policy plugs in.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.music3_graph_buffers import StaticBufferPool, with_decode_buffers
from .emulated_capture import emulated_capture

Q4_0_BLOCK = 32
Q4_0_TYPE = 2


@dataclass(frozen=True)
class TinyConfig:
    hidden: int = 256
    heads: int = 4
    layers: int = 8
    intermediate: int = 512
    capacity: int = 128
    vocab: int = 512

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Small enough for the doctor's self-tests on a CPU, deep enough that a stale replay reaches the next layer's input.
SMALL_CONFIG = TinyConfig(hidden=64, heads=4, layers=3, intermediate=128, capacity=16, vocab=64)


def quantize_q4_0(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 blocks (fp16 scale + 16 bytes of nibbles per 32 values), bit-identical to ``gguf.quants``."""
    blocks = weight.detach().float().reshape(-1, Q4_0_BLOCK)
    peak = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
    scale = peak / -8
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    nibbles = torch.trunc(blocks * inverse + 8.5).to(torch.uint8).clamp(0, 15).reshape(-1, 2, Q4_0_BLOCK // 2)
    low, high = nibbles.unbind(1)
    packed = low | (high << 4)
    return torch.cat((scale.to(torch.float16).view(torch.uint8), packed), dim=1)


def dequantize_q4_0(blocks: torch.Tensor, shape, dtype=torch.float32) -> torch.Tensor:
    """Q4_0 back to floats, the way ComfyUI-GGUF does it: the nibble shifts come from a Python list, which is a
    pageable host-to-device copy whenever ``blocks`` live on a GPU (the copy stream capture refuses)."""
    scale, packed = blocks.split((2, Q4_0_BLOCK // 2), dim=1)
    scale = scale.view(torch.float16).float()
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=blocks.device).reshape(1, 2, 1)
    nibbles = (packed.reshape(-1, 1, Q4_0_BLOCK // 2) >> shifts) & 0x0F
    values = nibbles.reshape(-1, Q4_0_BLOCK).to(torch.int8) - 8
    return (scale * values.float()).reshape(shape).to(dtype)


class GGUFStyleQ4Linear(torch.nn.Module):
    """A bias-free linear layer with a Q4_0 weight dequantized on every call, marked like a ComfyUI-GGUF weight
    (``tensor_type``/``tensor_shape``). Build it on the device it computes on: ``.to()`` drops the marks."""

    def __init__(self, blocks: torch.Tensor, shape):
        super().__init__()
        self.register_buffer("weight", blocks)
        self.weight.tensor_type = Q4_0_TYPE
        self.weight.tensor_shape = tuple(shape)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "GGUFStyleQ4Linear":
        return cls(quantize_q4_0(linear.weight), linear.weight.shape)

    def forward(self, x):
        return F.linear(x, dequantize_q4_0(self.weight, self.weight.tensor_shape, x.dtype))


class HostWeightLinear(torch.nn.Module):
    """A bias-free linear layer whose weight stays in host memory and is copied to the input's device per call."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.device, non_blocking=True))


def rope_table(position: int, head_dim: int, device) -> torch.Tensor:
    """cos/sin for one position, shape (2, head_dim // 2), computed on ``device`` (a fresh tensor every step)."""
    half = head_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    angles = torch.full((1,), float(position), device=device) * inv_freq
    return torch.stack((angles.cos(), angles.sin()))


def _apply_rope(x, rope):
    first, second = x.chunk(2, dim=-1)
    cos, sin = rope.to(x.dtype).unbind(0)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class TinyLayer(torch.nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        hidden, inner = config.hidden, config.intermediate
        self.heads, self.head_dim = config.heads, config.head_dim
        self.input_norm = torch.nn.Parameter(torch.ones(hidden))
        self.q_proj, self.k_proj = torch.nn.Linear(hidden, hidden, bias=False), torch.nn.Linear(hidden, hidden, bias=False)
        self.v_proj, self.o_proj = torch.nn.Linear(hidden, hidden, bias=False), torch.nn.Linear(hidden, hidden, bias=False)
        self.post_norm = torch.nn.Parameter(torch.ones(hidden))
        self.gate_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.down_proj = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x, rope, key_cache, value_cache, position):
        batch = x.shape[0]
        h = F.rms_norm(x, (x.shape[-1],), self.input_norm.to(x.dtype), 1e-6)
        q = _apply_rope(self.q_proj(h).view(batch, 1, self.heads, self.head_dim), rope)
        k = _apply_rope(self.k_proj(h).view(batch, 1, self.heads, self.head_dim), rope)
        key_cache.index_copy_(1, position, k)
        value_cache.index_copy_(1, position, self.v_proj(h).view(batch, 1, self.heads, self.head_dim))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, key_cache) * self.head_dim ** -0.5
        future = torch.arange(key_cache.shape[1], device=x.device) > position
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1, dtype=torch.float32).to(x.dtype)
        x = x + self.o_proj(torch.einsum("bhqk,bkhd->bqhd", probs, value_cache).reshape(batch, 1, -1))
        h = F.rms_norm(x, (x.shape[-1],), self.post_norm.to(x.dtype), 1e-6)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyCache:
    """A fixed-capacity KV cache with a device-side write position (like ComfyUI's ``FixedKV``)."""

    def __init__(self, config: TinyConfig, batch, device, dtype):
        shape = (batch, config.capacity, config.heads, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.layers)]
        self.position = torch.zeros((1,), device=device, dtype=torch.int64)
        self.index = 0


class TinyDecoder(torch.nn.Module):
    graph_dynamic_vbar_blocks = True

    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        self.embed = torch.nn.Embedding(config.vocab, config.hidden)
        self.layers = torch.nn.ModuleList(TinyLayer(config) for _ in range(config.layers))
        self.norm = torch.nn.Parameter(torch.ones(config.hidden))
        self.runner = None

    def init_decode_buffers(self, batch, device, dtype):
        hidden = torch.empty((batch, 1, self.config.hidden), device=device, dtype=dtype)
        return hidden, torch.empty((2, self.config.head_dim // 2), device=device, dtype=torch.float32)

    def forward(self, x=None, embeds=None, past_key_values=None, decode_buffers=None):
        x, cache = embeds, past_key_values
        rope = rope_table(cache.index, self.config.head_dim, x.device)
        enable_graph = self.graph_dynamic_vbar_blocks and x.shape[1] == 1 and cache.index > 0
        if enable_graph:
            if decode_buffers is None:
                x = x.clone()
            else:
                hidden, rope_buffer = decode_buffers
                hidden.copy_(x)
                x = hidden
                rope_buffer.copy_(rope)
                rope = rope_buffer
        cache.position.fill_(cache.index)
        for i, layer in enumerate(self.layers):
            def core(layer=layer, i=i):
                nonlocal x
                output = layer(x, rope, cache.keys[i], cache.values[i], cache.position)
                if enable_graph:
                    x.copy_(output)
                else:
                    x = output

            if self.runner is None:
                core()
            else:
                self.runner.run(layer, core, enable_graph)
        cache.index += 1
        return F.rms_norm(x, (x.shape[-1],), self.norm.to(x.dtype), 1e-6), None, cache


def build_decoder(config: TinyConfig, device, dtype=torch.float32, q4_layers=(), seed=0) -> TinyDecoder:
    """Seeded weights (the same for any device), with the MLP ``down_proj`` of ``q4_layers`` as GGUF-style Q4_0.
    The weights come from a forked CPU generator, so the caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):  # built on the CPU: only the CPU generator draws
        torch.default_generator.manual_seed(seed)
        model = TinyDecoder(config)
    model = model.eval().to(device=device, dtype=dtype)
    for index in q4_layers:
        model.layers[index].down_proj = GGUFStyleQ4Linear.from_linear(model.layers[index].down_proj)
    return model


def decode_hidden_states(model: TinyDecoder, steps: int, runner=None, static_buffers=False, device="cpu",
                         dtype=torch.float32, batch=2) -> torch.Tensor:
    """``ar_decode`` with ``runner`` running the per-layer graph units (None: graphs off) and, with
    ``static_buffers``, the decode-buffer fix wrapped around the forward as the pack wraps ComfyUI's."""
    model.runner = runner
    if static_buffers:
        model.forward = with_decode_buffers(model, model.forward, StaticBufferPool(), lambda: False)
    try:
        return ar_decode(model, steps, batch=batch, device=device, dtype=dtype)
    finally:
        model.runner = None
        vars(model).pop("forward", None)


def ar_decode(model: TinyDecoder, steps: int, batch: int = 2, device="cpu", dtype=torch.float32, first_token=1):
    """Greedy AR decoding like Music 3's loop (one token per step, fed back as embeddings without a host sync).
    Returns the final hidden state of every step, stacked."""
    cache = TinyCache(model.config, batch, device, dtype)
    tokens = torch.full((batch, 1), first_token, device=device, dtype=torch.long)
    hidden_states = []
    for _ in range(steps):
        embeds = model.embed(tokens).to(dtype)
        output = model(None, embeds=embeds, past_key_values=cache)[0]
        hidden_states.append(output.clone())
        tokens = (output @ model.embed.weight.to(dtype).T).argmax(dim=-1)
    return torch.stack(hidden_states)


class _GraphRunner:
    def __init__(self, capture_allowed=None):
        self.capture_allowed = capture_allowed
        self.graphs = {}
        # The capture-time closures keep the capture step's tensors allocated, so a replay that reads a stale address
        # reads that step's values (deterministic) rather than whatever reused the block (allocator-dependent).
        self.captured_cores = []
        self.warmed = set()
        self.refused = set()

    def run(self, module, core, enable_graph):
        if not enable_graph:
            core()
        elif self.capture_allowed is not None and not self.capture_allowed(module):
            self.refused.add(module)
            core()
        elif module in self.graphs:
            self._replay(self.graphs[module])
        elif module in self.warmed:
            self.graphs[module] = self._capture(core)
            self.captured_cores.append(core)
        else:
            self._warm_up(core)
            self.warmed.add(module)


class EmulatedGraphs(_GraphRunner):
    """CPU stand-in for per-unit CUDA graphs. With ``capture_rules`` the capture runs under ``emulated_capture``."""

    def __init__(self, capture_allowed=None, capture_rules=False):
        super().__init__(capture_allowed)
        self.capture_rules = capture_rules

    def _warm_up(self, core):
        core()

    def _capture(self, core):
        with emulated_capture() if self.capture_rules else contextlib.nullcontext():
            core()
        return core

    def _replay(self, captured_core):
        captured_core()


class CudaGraphs(_GraphRunner):
    """Per-unit ``torch.cuda.CUDAGraph`` capture on a side stream, as ``comfy.model_prefetch`` does it."""

    def __init__(self, device, capture_allowed=None):
        super().__init__(capture_allowed)
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def _warm_up(self, core):
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            core()
        current.wait_stream(self.stream)

    def _capture(self, core):
        current = torch.cuda.current_stream(self.device)
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(current)
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
            core()
        current.wait_stream(self.stream)
        graph.replay()
        return graph

    def _replay(self, graph):
        graph.replay()
