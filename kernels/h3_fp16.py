"""MiniMax H3's DiT in fp16 without overflow: the fp32 residual stream, the rescaled branch outputs, and a tiny H3
whose activations overflow fp16 where the real model's do.

fp16 tops out at 65504. Three places of the real model exceed it (``patches/h3_fp16_overflow.py`` says which and
why); each is computed here so that no fp16 tensor ever holds a value out of range, while the projections, about
99% of the work, stay fp16 matmuls:

* ``condition_proj`` (Qwen3-VL states in, the text rows out) runs in fp32, and the token refiner carries its
  residual in fp32 (``token_refiner_fp32_stream``);
* each DiT block carries the residual stream in fp32 (``dit_block_fp32_stream``): the normalized, modulated branch
  inputs go to fp16, the gated adds accumulate in fp32; the stream leaves the last block in fp32 and the final
  layer's norm takes it as it is;
* the attention ``out_proj`` and MLP ``fc2`` outputs are computed as ``f(x / K) * K`` (``BRANCH_RESCALE``), exact
  because both are linear and bias-free and K is a power of two: dividing and multiplying by it changes only the
  exponent, so the result is bit-for-bit ``f(x)`` wherever no element of ``x / K`` falls below fp16's smallest
  normal number (``2**-14``; below it the element keeps fewer mantissa bits, an absolute error under ``K * 2**-25``).
  For ``fc2`` the ``up`` half of ``fc1``'s output is divided instead (``silu(gate) * up / K``), so the swiglu
  product inside ``fc2``'s input is scaled before it can overflow and every fc2 backend (eager, fused int8) sees
  it already scaled.

Per-call state lives in context variables, never on a module: ``fp32_stream_call`` marks a DiT call that carries
its stream in fp32 (set by the model's entry points where it computes in fp16), ``branches_rescaled`` the duration
of one branch call inside a block.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from contextvars import ContextVar

import torch
from torch.utils._pytree import tree_flatten, tree_map

FP16_MAX = torch.finfo(torch.float16).max
# A power of two: divides and multiplies exactly. 2**8 gives the branch outputs 256 times fp16's range (the real
# model's fc2 reaches about 2M, 32 times the range), and leaves inputs above 2**-6 in fp16's normal range.
BRANCH_RESCALE = 2.0 ** 8

_stream_compute: ContextVar[torch.dtype | None] = ContextVar("minimax_hotfix_h3_fp32_stream", default=None)
_branch_rescale: ContextVar[float] = ContextVar("minimax_hotfix_h3_branch_rescale", default=1.0)


@contextlib.contextmanager
def fp32_stream_call(compute: torch.dtype | None):
    """Marks the code inside as one H3 DiT call that carries its stream in fp32 while its branches compute in
    ``compute`` (None: the model's own code, unchanged)."""
    token = _stream_compute.set(compute)
    try:
        yield
    finally:
        _stream_compute.reset(token)


def fp32_stream_compute() -> torch.dtype | None:
    """The branches' dtype of the H3 DiT call running now, where it carries its stream in fp32; else None."""
    return _stream_compute.get()


@contextlib.contextmanager
def branches_rescaled(scale: float = BRANCH_RESCALE):
    token = _branch_rescale.set(scale)
    try:
        yield
    finally:
        _branch_rescale.reset(token)


def divide_projection_input(module, args):
    """Forward pre-hook of an attention ``out_proj``: its input divided by the branch rescale, inside a rescaled
    branch call."""
    scale = _branch_rescale.get()
    if scale == 1.0 or not args or not isinstance(args[0], torch.Tensor):
        return None
    return (args[0] / scale, *args[1:])


def divide_up_half(module, args, output):
    """Forward hook of an MLP's ``fc1`` (swiglu: gate, then up): the up half divided by the branch rescale, inside a
    rescaled branch call, so that ``fc2(silu(gate) * up)`` comes out divided by it."""
    scale = _branch_rescale.get()
    if scale != 1.0 and isinstance(output, torch.Tensor):
        output[..., output.shape[-1] // 2:].div_(scale)
    return None


def linear_fp32(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` computed in fp32: ComfyUI's own cast path (offloaded weights, LoRA patches) casts the weight
    to the input's dtype."""
    x = x.to(torch.float32)
    cast = getattr(linear, "forward_comfy_cast_weights", None)
    if cast is not None:
        return cast(x)
    bias = None if linear.bias is None else linear.bias.to(x)
    return torch.nn.functional.linear(x, linear.weight.to(x), bias)


def norm_fp32(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm of the fp32 stream, its weight cast to fp32 (ComfyUI's cast path where the op has one)."""
    cast = getattr(norm, "forward_comfy_cast_weights", None)
    if cast is not None:
        return cast(x)
    weight = None if norm.weight is None else norm.weight.to(x)
    return torch.nn.functional.rms_norm(x, norm.normalized_shape, weight, norm.eps)


def dit_block_fp32_stream(block, helpers, x, t_emb, mod_segments, rope_freqs, transformer_options, attention=None,
                          scale: float = BRANCH_RESCALE) -> torch.Tensor:
    """One H3 ``DiTBlock`` with its residual stream in fp32; the branches compute in ``rope_freqs``' dtype.

    ``helpers`` is the block's module (its ``_mod_scale_shift`` and ``_mod_gate``). Same operations in the same
    order as the block's own forward: in fp32, the result is bit-for-bit the block's."""
    compute = rope_freqs.dtype
    stream = x if x.dtype == torch.float32 else x.to(torch.float32)
    attention = block.attn if attention is None else attention
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaln_proj(t_emb)
    h = helpers._mod_scale_shift(norm_fp32(block.norm1, stream), shift_msa, scale_msa, mod_segments).to(compute)
    with branches_rescaled(scale):
        out = attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options)
    stream = helpers._mod_gate(stream, gate_msa.to(torch.float32) * scale, out, mod_segments)
    h = helpers._mod_scale_shift(norm_fp32(block.norm2, stream), shift_mlp, scale_mlp, mod_segments).to(compute)
    with branches_rescaled(scale):
        out = block.mlp(h)
    return helpers._mod_gate(stream, gate_mlp.to(torch.float32) * scale, out, mod_segments)


def refiner_block_fp32_stream(block, stream, compute, transformer_options, scale: float = BRANCH_RESCALE):
    """One H3 ``RefinerBlock`` on the fp32 ``stream``; the branches compute in ``compute``."""
    with branches_rescaled(scale):
        out = block.attn(norm_fp32(block.norm1, stream).to(compute), transformer_options=transformer_options)
    stream = out.to(torch.float32).mul_(scale).add_(stream)
    with branches_rescaled(scale):
        out = block.mlp(norm_fp32(block.norm2, stream).to(compute))
    return out.to(torch.float32).mul_(scale).add_(stream)


def token_refiner_fp32_stream(refiner, x, compute, transformer_options):
    """H3's ``TokenRefiner`` with its residual in fp32; its output, normalized, in ``compute``. Each block is called
    as a module, so that its own hooks run (FSDP unshards a sharded block's weights in one: raylight shards every
    block), and its override (``_refiner_forward`` with ``refiner_block_fp32_stream``) carries the fp32 stream."""
    stream = x.to(torch.float32)
    for block in refiner.blocks:
        stream = block(stream, transformer_options=transformer_options)
    return norm_fp32(refiner.final_norm, stream).to(compute)


DIT_PARTS = ("condition_proj", "token_refiner", "blocks", "final_layer", "_forward")


def is_h3_dit(module) -> bool:
    """Whether ``module`` is a MiniMax H3 DiT: the parts this fix changes, found by what it holds (a core that
    renamed ``MiniMaxH3Model`` keeps them)."""
    return all(hasattr(module, part) for part in DIT_PARTS) and hasattr(module.final_layer, "norm")


def helpers_of(block):
    """The module defining ``block``'s class (its ``_mod_scale_shift`` and ``_mod_gate``): the first class of its MRO
    whose module has them, as FSDP's ``fully_shard`` (raylight's weight sharding) swaps the block's class for a
    subclass of its own, defined in torch's module."""
    for cls in type(block).__mro__:
        module = inspect.getmodule(cls)
        if hasattr(module, "_mod_scale_shift") and hasattr(module, "_mod_gate"):
            return module
    return inspect.getmodule(type(block))


def all_finite(outputs) -> torch.Tensor:
    """Whether every floating-point tensor in ``outputs`` (a tensor, or lists and tuples of them) is finite, as one
    flag on their device: nothing is read back here."""
    flags = [torch.isfinite(tensor).all() for tensor in tree_flatten(outputs)[0]
             if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()]
    return torch.stack([flag.to(flags[0].device) for flag in flags]).all() if flags else torch.tensor(True)


def _widened(value):
    """``value``'s fp16 tensors (lists and tuples of them too) in fp32; anything else as it is."""
    return tree_map(lambda item: item.float() if isinstance(item, torch.Tensor) and item.dtype == torch.float16
                    else item, value)


def _like(value, reference):
    """``value``'s floating-point tensors in the dtypes of ``reference``'s, position by position."""
    return tree_map(lambda item, like: item.to(like.dtype) if isinstance(item, torch.Tensor)
                    and item.is_floating_point() else item, value, reference)


def _entry_point(stock, inputs: tuple[str, ...], switched_off, net, keep_output_dtypes: bool = False):
    """``stock`` (the DiT's ``forward`` or ``preprocess_text_embeds``), marking the call as fp32-stream when the
    text states it gets are fp16. ``inputs``: the names of ``stock``'s leading parameters, the text states last.
    ``forward``, not ``_forward``: multi-GPU nodes (raylight's sequence parallelism) replace the DiT's ``_forward``
    and its attention's ``forward`` with their own on every load; the mark around ``forward`` holds whichever
    ``_forward`` runs inside, in either order of the two injections.

    The safety net (where ``net`` is given): ``net.checked()`` counts the marked call, whose outputs are checked for
    finiteness once, on the device, and read back once. Where an activation left fp16's range even rescaled, the
    inf reaches both outputs (through the attention and the final norm; a text row that overflows after the last
    attention reaches neither, and then nothing is wrong), so the outputs' flag trips exactly when the call's result
    is unusable. Then ``net.tripped(stock.__name__, given)`` reports it (``given``: the ``inputs`` passed, by name)
    and the call runs again with its fp16 inputs in fp32 and nothing marked: the model's own code in fp32 (ComfyUI's
    ops cast each weight to the input's dtype). Its outputs stay fp32, as an fp32 call returns them (ComfyUI's model
    takes the DiT's output to fp32 anyway), or, with ``keep_output_dtypes``, go to the fp16 call's dtypes
    (``preprocess_text_embeds``: its output is the context of fp16 calls to come)."""
    context_name = inputs[-1]

    def call(*args, **kwargs):
        given = {**dict(zip(inputs, args, strict=False)), **{key: kwargs[key] for key in inputs if key in kwargs}}
        context = given.get(context_name)
        outer = fp32_stream_compute()
        compute = outer
        if compute is None and isinstance(context, torch.Tensor) and context.dtype == torch.float16 \
                and not switched_off():
            compute = torch.float16
        with fp32_stream_call(compute):
            out = stock(*args, **kwargs)
        if compute is None or outer is not None or net is None:
            return out
        net.checked()
        if bool(all_finite(out)):
            return out
        net.tripped(stock.__name__, given)
        args = tuple(_widened(arg) if index < len(inputs) else arg for index, arg in enumerate(args))
        kwargs = {key: _widened(value) if key in inputs else value for key, value in kwargs.items()}
        with fp32_stream_call(None):
            again = stock(*args, **kwargs)
        return _like(again, out) if keep_output_dtypes else again
    return call


def _block_forward(block, stock):
    helpers = helpers_of(block)

    def forward(x, t_emb, mod_segments, rope_freqs, transformer_options=None, **newer):
        transformer_options = {} if transformer_options is None else transformer_options
        if fp32_stream_compute() is None:
            return stock(x, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options, **newer)
        return dit_block_fp32_stream(block, helpers, x, t_emb, mod_segments, rope_freqs, transformer_options,
                                     attention=newer.get("attention"))
    return forward


def _refiner_forward(module, stock, fp32_stream):
    """The token refiner's or one of its blocks' ``forward``: ``fp32_stream(module, x, compute, transformer_options)``
    in an fp32-stream call, ``stock`` otherwise."""
    def forward(x, transformer_options=None):
        transformer_options = {} if transformer_options is None else transformer_options
        compute = fp32_stream_compute()
        if compute is None:
            return stock(x, transformer_options=transformer_options)
        return fp32_stream(module, x, compute, transformer_options)
    return forward


def _fp32_when_streaming(module, stock, fp32):
    def forward(x, *args, **kwargs):
        if fp32_stream_compute() is None or args or kwargs:
            return stock(x, *args, **kwargs)
        return fp32(module, x)
    return forward


def fp32_stream_forwards(dit, switched_off, net=None) -> list[tuple]:
    """The instance attributes that give one H3 DiT its fp32 stream in fp16 calls (none while ``switched_off()``),
    as ``(object, attribute, value)``: each value wraps the attribute the object has now. ``net``: the safety net's
    record (``checked()``, ``tripped(name, inputs)``; ``_entry_point``); None: no net."""
    norm = dit.final_layer.norm
    forwards = [(dit, "forward", _entry_point(dit.forward, ("x", "timestep", "context"), switched_off, net)),
                (dit.condition_proj, "forward",
                 _fp32_when_streaming(dit.condition_proj, dit.condition_proj.forward, linear_fp32)),
                (dit.token_refiner, "forward",
                 _refiner_forward(dit.token_refiner, dit.token_refiner.forward, token_refiner_fp32_stream)),
                (norm, "forward", _fp32_when_streaming(norm, norm.forward, norm_fp32))]
    if hasattr(dit, "preprocess_text_embeds"):
        forwards.append((dit, "preprocess_text_embeds",
                         _entry_point(dit.preprocess_text_embeds, ("text_states",), switched_off, net,
                                      keep_output_dtypes=True)))
    return (forwards + [(block, "forward", _refiner_forward(block, block.forward, refiner_block_fp32_stream))
                        for block in dit.token_refiner.blocks]
            + [(block, "forward", _block_forward(block, block.forward)) for block in dit.blocks])


def rescale_hooks(dit) -> list:
    """The branch rescale's hooks on every attention ``out_proj`` and MLP ``fc1`` of one H3 DiT (its refiner's
    too); returns the torch hook handles."""
    handles = []
    for block in [*dit.token_refiner.blocks, *dit.blocks]:
        handles.append(block.attn.out_proj.register_forward_pre_hook(divide_projection_input))
        handles.append(block.mlp.fc1.register_forward_hook(divide_up_half))
    return handles


# A tiny MiniMax H3 DiT: every dimension ComfyUI reads from a checkpoint, small; the latents keep their real channels,
# the rope rotates 3 axes x 2 x rope_inv_freq_len of each head's 32 dimensions; the text width differs from the
# hidden width, as in the real model (5120, 5376): the DiT runs condition_proj only then.
TINY_H3 = {"hidden_size": 64, "num_layers": 4, "token_refiner_num_layers": 1, "num_attention_heads": 2,
           "attention_head_dim": 32, "ffn_hidden_size": 128, "latents_dim": 24, "audio_latents_dim": 32,
           "text_dim": 48, "timestep_input_dim": 256, "time_embed_hidden_size": 64, "time_embed_dim": 32,
           "rope_inv_freq_len": 4}
# The real model's magnitudes, as a public analysis of it measured them at 1120x768, 124 frames: condition_proj
# about 96k, an attention-sink row from about 81k after the first block to about 4.3M after the last, fc2 above 2M.
CONDITION_PROJ_PEAK = 96_000.0
SINK_AFTER_FIRST_BLOCK = 100_000.0
SINK_GROWTH_PER_BLOCK = 3.0
MASSIVE_ACTIVATION = 300.0  # the Qwen3-VL state's massive channel on the first text token
FC2_WEIGHT_LIMIT = 2e4  # the tiny H3's largest fc2 weight, well inside fp16's range


def tiny_h3_state(model: torch.nn.Module, overflow: bool, seed: int = 0,
                  sink_growth: float = SINK_GROWTH_PER_BLOCK) -> dict:
    """A state dict for ``model`` (a tiny ComfyUI ``MiniMaxH3Model``, any number of blocks): random small weights,
    plus, with ``overflow``, the structure that makes the real model leave fp16's range.

    The first text token carries a massive activation in channel 0 (``tiny_h3_inputs``), as the Qwen3-VL state
    does; ``condition_proj`` maps it to about ``CONDITION_PROJ_PEAK``. After the token refiner's final norm that
    row is almost all channel 0, the attention sink: each block's MLP (fc1 unit 0 reading channel 0, fc2 writing it
    back) adds to it an fc2 output that starts at ``SINK_AFTER_FIRST_BLOCK`` and grows ``SINK_GROWTH_PER_BLOCK``
    times per block (``sink_growth``: a faster growth takes the last fc2 past the branch rescale's envelope), so the
    sink grows tens of times through the stack; the second block's attention writes a value past fp16's range
    through ``out_proj``. Every weight stays inside fp16's range: the magnitudes come from products, as in the real
    model (for a fast growth fc1's gain rises, so that fc2's weight need not)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = model.hidden_size
    state = {}
    for name, tensor in model.state_dict().items():
        fan_in = tensor.shape[-1] if tensor.dim() > 1 else 1
        if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):  # q_norm, k_norm, final_norm too
            value = torch.ones(tensor.shape)
        elif name.endswith(".bias"):
            value = torch.zeros(tensor.shape)
        elif name == "rope.inv_freq":
            value = 1.0 / (10000.0 ** (torch.arange(tensor.shape[0], dtype=torch.float32) / tensor.shape[0]))
        else:
            value = torch.randn(tensor.shape, generator=generator) / math.sqrt(fan_in)
        state[name] = value
    for name, value in state.items():  # modulation: scale and shift near 0, gates near 1
        if name.endswith("adaln_proj.linear.weight"):
            value.mul_(0.01)
        if name.endswith("adaln_proj.linear.bias") and name.startswith("blocks."):
            rows = value.view(3, 6, hidden)
            rows[:, 2] = 1.0
            rows[:, 5] = 1.0
    if overflow:
        state["condition_proj.weight"][0].zero_()
        state["condition_proj.weight"][0, 0] = CONDITION_PROJ_PEAK / MASSIVE_ACTIVATION
        ffn = state["blocks.0.mlp.fc2.weight"].shape[1]
        sink_norm = math.sqrt(hidden)  # a row that is all channel 0, RMS-normalized
        fc2_peak = SINK_AFTER_FIRST_BLOCK * sink_growth ** (len(model.blocks) - 1)
        gain = max(2.0, math.sqrt(fc2_peak / FC2_WEIGHT_LIMIT) / sink_norm)
        for index in range(len(model.blocks)):
            prefix = f"blocks.{index}."
            fc1 = state[prefix + "mlp.fc1.weight"]
            fc1[0].zero_()
            fc1[0, 0] = gain
            fc1[ffn].zero_()
            fc1[ffn, 0] = gain
            swiglu = (gain * sink_norm) ** 2  # about silu(g) * u with g = u = gain * sink_norm
            state[prefix + "mlp.fc2.weight"][:, 0].zero_()
            state[prefix + "mlp.fc2.weight"][0, 0] = SINK_AFTER_FIRST_BLOCK * sink_growth ** index / swiglu
        qkv = state["blocks.1.attn.qkv_proj.weight"]
        inner = qkv.shape[0] // 3
        qkv[2 * inner].zero_()
        qkv[2 * inner, 0] = 4.0  # the sink's value, channel 0 of head 0
        state["blocks.1.attn.out_proj.weight"][0, 0] = 4.0 * SINK_AFTER_FIRST_BLOCK / (4.0 * sink_norm)
    return state


def _eager(layer: type) -> type:
    class Eager(layer):
        def _load_from_state_dict(self, *args, **kwargs):
            return super()._load_from_state_dict(*args, **kwargs)

    Eager.__name__ = Eager.__qualname__ = layer.__name__
    return Eager


def eager_ops(ops) -> type:
    """``ops`` whose layers have their weights from construction on. Under dynamic VRAM ComfyUI builds its Linear and
    Embedding without weights (``weight is None``, made by ``load_state_dict``) unless the layer loads its own state
    dict: these layers do (their loader is ComfyUI's), so a model built with them declares every weight's shape and
    dtype."""
    layers = {name: _eager(value) for name in dir(ops) if inspect.isclass(value := getattr(ops, name))
              and issubclass(value, torch.nn.Module)}
    return type(f"eager_{ops.__name__}", (ops,), layers)


def tiny_h3_model(model_class, ops, dtype: torch.dtype, overflow: bool, config: dict | None = None,
                  sink_growth: float = SINK_GROWTH_PER_BLOCK):
    """A tiny ``model_class`` (ComfyUI's ``MiniMaxH3Model``) on the CPU with ``ops``, its weights in ``dtype``
    from ``tiny_h3_state`` (the global random state is left alone). The weights go in through ``load_state_dict``,
    as ComfyUI loads a model, each in the dtype the model declares for it (under dynamic VRAM ComfyUI's layers take a
    weight's dtype from the state dict)."""
    config = {**TINY_H3, **(config or {})}
    with torch.device("meta"):
        declared = model_class(**config, dtype=dtype, operations=eager_ops(ops))
    state = tiny_h3_state(declared, overflow, sink_growth=sink_growth)
    dtypes = {name: tensor.dtype for name, tensor in declared.state_dict().items()}
    model = model_class(**config, dtype=dtype, device="cpu", operations=ops)
    model.load_state_dict({name: value.to(dtypes[name]) for name, value in state.items()})
    return model.eval().requires_grad_(False)


def tiny_h3_inputs(dtype: torch.dtype, sigma: float = 0.6, seed: int = 1) -> dict:
    """Keyword arguments of one tiny H3 forward in ``dtype``: a 2 x 4 x 4 video latent, 3 audio frames, 6 text
    tokens of Qwen3-VL state whose first carries a massive activation in channel 0."""
    generator = torch.Generator().manual_seed(seed)
    video = torch.randn(1, TINY_H3["latents_dim"], 2, 4, 4, generator=generator)
    audio = torch.randn(1, TINY_H3["audio_latents_dim"], 2, 3, generator=generator)
    context = torch.randn(1, 6, TINY_H3["text_dim"], generator=generator)
    context[0, 0, 0] = MASSIVE_ACTIVATION
    return {"x": [video.to(dtype), audio.to(dtype)], "timestep": torch.tensor([sigma * 1000.0]),
            "context": context.to(dtype), "transformer_options": {}, "minimax_payload": {}}


def tiny_h3_outputs(model, dtype: torch.dtype, device=None, stream_compute: torch.dtype | None = None,
                    sigma: float = 0.6) -> torch.Tensor:
    """One forward of a tiny H3 on ``tiny_h3_inputs(dtype)`` (on ``device``), its video and audio outputs flattened
    into one fp32 vector. ``stream_compute``: run it as a call marked for the fp32 stream (``fp32_stream_call``)."""
    inputs = tiny_h3_inputs(dtype, sigma)
    if device is not None:
        inputs = {**inputs, "x": [part.to(device) for part in inputs["x"]], "context": inputs["context"].to(device)}
    with torch.no_grad(), fp32_stream_call(stream_compute):
        out = model(**inputs)
    return torch.cat([part.reshape(-1).to(torch.float32) for part in out])
