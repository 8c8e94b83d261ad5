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
caller, passes ``decode_buffers`` from a per-model ``StaticBufferPool`` (kernels/music3_graph_buffers.py): the buffers come
from the decoder's own ``init_decode_buffers`` and keep their addresses for the whole AR run, reallocated only when the
hidden state's shape, stride, dtype or device changes. Graphs stay on. ``--disable-cuda-graphs`` is honoured (nothing
is passed then), a caller that passes its own buffers is untouched, and ejecting the model removes the override.
"""

from __future__ import annotations

import inspect

from ..contract import AttributeOverride, Fix, Retirement, State, Status, Target
from ..contract.comfy import is_music3_text_encoder
from ..kernels.music3_graph_buffers import StaticBufferPool, with_decode_buffers

FIX_ID = "music3_graph_buffers"


def cuda_graphs_disabled() -> bool:
    try:
        from comfy.cli_args import args
    except ImportError:
        return False
    return bool(getattr(args, "disable_cuda_graphs", False))


class Music3GraphBuffers(Fix):
    id = FIX_ID
    targets = (Target.CLIP,)
    retirement = Retirement(
        fixed_by="Comfy-Org/ComfyUI PR #16428 (merged 2026-09-20: the AR loop passes init_decode_buffers(...))",
        delete_when="every supported core has PR #16428 or predates Comfy Compiler #15861 (this fix reads 'fixed "
                    "upstream' or 'not affected' on all of them)")

    def detect(self) -> Status:
        try:
            import comfy.ldm.minimax_music.ar as ar
            import comfy.text_encoders.llama as llama
        except ImportError:
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
        return Status(State.NEEDED, "MiniMaxMusic3AR.generate calls Llama2_ without decode_buffers: graphed decode "
                                     "steps clone the hidden state and replays read stale addresses (#16222)")

    def hook_loaded_model(self, text_encoder) -> list:
        if not is_music3_text_encoder(text_encoder):
            return []
        decoder = text_encoder.model  # its Llama2_
        pooled = with_decode_buffers(decoder, decoder.forward, StaticBufferPool(), cuda_graphs_disabled)
        return [AttributeOverride(decoder, "forward", pooled)]


FIX = Music3GraphBuffers()
