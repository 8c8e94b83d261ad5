"""music3_graph_buffers: MiniMax Music 3 with CUDA graphs on produces the same audio as with graphs off.

Bug: the Comfy Compiler (#15861) removed the cross-step static buffers from ``Llama2_.forward``; a graphed decode step
now clones the hidden state (``x = x.clone()``) unless its caller passes ``decode_buffers``. ``MiniMaxMusic3AR.generate``
runs its own decode loop and passes none, so every per-layer graph replays against the addresses of the step it was
captured on. No error: the AR stage emits garbage codes and the music is pure noise (NaN audio, a constant -32768 in
the saved file; the RDNA4 report measures max abs diff 123 on conditioning of max abs 132).

Upstream: Comfy-Org/ComfyUI issue #16222 (open) and the second report in #16002; fixed by PR #16428 (merged
2026-09-20), which passes ``init_decode_buffers(...)`` from the AR loop. PR #15570 introduced the graphs with the
cross-step state, PR #15861 removed it.

Applies to: ComfyUI cores with #15861 and without #16428 (Comfy Compiler graphs are on by default from 0.35).

Detection (code structure, not versions): ``Llama2_.forward`` that still keeps ``_comfy_cross_step_state``
(0.33.0 / 0.34) is not affected; one that accepts ``decode_buffers`` while ``MiniMaxMusic3AR.generate`` passes them is
fixed upstream; one that accepts ``decode_buffers`` while ``generate`` does not needs the fix; anything else (no
cross-step state, no ``decode_buffers``, no ``init_decode_buffers``) disables the fix as drifted.

Off switch: ``MINIMAX_HOTFIX_DISABLE=music3_graph_buffers``.

How: attached to CLIP patchers as an injection that acts only on a Music 3 text encoder. It gives that encoder's
``Llama2_`` an instance ``forward`` which, on single-token decode steps with graphs enabled and no buffers from the
caller, passes ``decode_buffers`` from a per-model ``StaticBufferPool`` (kernels/static_buffers.py): the buffers come
from the decoder's own ``init_decode_buffers`` and keep their addresses for the whole AR run, reallocated only when the
hidden state's shape, stride, dtype or device changes. Graphs stay on. ``--disable-cuda-graphs`` is honoured (nothing
is passed then), a caller that passes its own buffers is untouched, and ejecting the model removes the override.
"""

from __future__ import annotations

import inspect

import torch

from ..kernels.static_buffers import StaticBufferPool, tensor_key, with_decode_buffers
from ..kernels.tiny_decoder import SMALL_CONFIG, CudaGraphs, EmulatedGraphs, build_decoder, decode_hidden_states
from ._comfy import comfy_module
from ._devices import real_accelerator
from ._fix import AttributeOverride, Check, Fix, State, Status, model_injection, set_injection

FIX_ID = "music3_graph_buffers"
SELF_TEST_STEPS = 8


def cuda_graphs_disabled() -> bool:
    args = getattr(comfy_module("comfy.cli_args"), "args", None)
    return bool(getattr(args, "disable_cuda_graphs", False))


def music3_decoder(text_encoder):
    """The ``Llama2_`` of a MiniMax Music 3 text encoder, or None for any other model."""
    ar = comfy_module("comfy.ldm.minimax_music.ar")
    if ar is None or not isinstance(text_encoder, ar.MiniMaxMusic3AR):
        return None
    return text_encoder.model


class Music3GraphBuffers(Fix):
    id = FIX_ID
    title = "MiniMax Music 3: static decode buffers for CUDA-graph replay (no more pure noise)"
    targets = ("clip",)
    upstream = "Comfy-Org/ComfyUI#16222, #16002; fixed by PR #16428"

    def detect(self) -> Status:
        llama = comfy_module("comfy.text_encoders.llama")
        ar = comfy_module("comfy.ldm.minimax_music.ar")
        if llama is None or ar is None:
            return Status(State.NOT_APPLICABLE, "ComfyUI with MiniMax Music 3 is not importable here")
        forward = llama.Llama2_.forward
        if "_comfy_cross_step_state" in inspect.getsource(forward):
            return Status(State.NOT_AFFECTED, "Llama2_.forward still copies each decode step into its cross-step "
                                              "static buffers (before Comfy Compiler #15861); replays read stable "
                                              "addresses")
        if "decode_buffers" not in inspect.signature(forward).parameters or not hasattr(llama.Llama2_,
                                                                                        "init_decode_buffers"):
            return Status(State.FAILED, "Llama2_.forward has neither cross-step buffers nor a decode_buffers "
                                          "parameter with init_decode_buffers: the code drifted, fix left off")
        if "decode_buffers" in inspect.getsource(ar.MiniMaxMusic3AR.generate):
            return Status(State.FIXED_UPSTREAM, "MiniMaxMusic3AR.generate passes decode_buffers (#16428)")
        return Status(State.APPLIED, "MiniMaxMusic3AR.generate calls Llama2_ without decode_buffers: graphed decode "
                                     "steps clone the hidden state and replays read stale addresses (#16222)")

    def install(self, text_encoder) -> list:
        decoder = music3_decoder(text_encoder)
        if decoder is None:
            return []
        pooled = with_decode_buffers(decoder, decoder.forward, StaticBufferPool(), cuda_graphs_disabled)
        return [AttributeOverride(decoder, "forward", pooled)]

    def attach(self, patcher, key: str) -> None:
        set_injection(patcher, key, model_injection(self.install))

    def self_test(self):
        """A tiny Llama-shaped decoder decoded like Music 3's AR loop, graphs off vs per-layer graphs: real CUDA
        graphs on a GPU, otherwise the CPU stand-in whose replays read the tensors bound at capture."""
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


FIX = Music3GraphBuffers()
