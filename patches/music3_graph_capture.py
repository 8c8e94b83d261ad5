"""music3_graph_capture: MiniMax Music 3 never starts a CUDA-graph capture over a unit that would copy from host memory.

Bug: Music 3's AR stage captures one CUDA graph per graph unit (each Llama layer, and the depth decoder with the audio
extra embedding) under dynamic VRAM. A unit whose forward copies from pageable host memory cannot be captured:
a GGUF text encoder (e.g. ``minimax_music3_text_encoder_pruned_Q4_0.gguf`` through ``CLIPLoaderGGUFDynamicVRAM``)
dequantizes Q4_0 with shift tables built from Python lists, so capture fails with
``RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned.``
(``comfy/ops.py -> tensor.dequantize()`` / ``ComfyUI-GGUF/dequant.py -> dequantize_blocks_Q4_0()``), followed by
``Warning: Attempting uncaptured free of a captured allocation`` and ``Fatal Python error: Aborted``. The same holds
for a weight left in unpinned host memory outside the dynamic-VRAM allocator.

Upstream: Comfy-Org/ComfyUI#16002 (closed with the workaround of switching both Music 3 graph paths off in
``ar.py``), molbal/ComfyUI-GGUF#17. No core fix known.

Applies to: every core with Music 3 graphs (#15570, 0.33.0 on), with dynamic VRAM (the default on NVIDIA).

Detection (code structure): needs ``comfy.model_prefetch.prefetch_queue_pop`` gating graphs on the unit's ``_v_block``
(in its own line or in a helper of its module it calls); if the gate is gone, the fix disables itself (drifted). The
units come from ``MiniMaxMusic3TEModel.get_dynamic_vram__units``, or, where a core renamed or dropped it, from the
modules the loader marked with ``_v_block``. Without ComfyUI/Music 3: not applicable.

Off switch: ``MINIMAX_HOTFIX_DISABLE=music3_graph_capture``.

How: attached to CLIP patchers (so also to a CLIP from the GGUF loaders, through "Apply MiniMax Hotfix (CLIP)") as an
injection that acts only on a Music 3 text encoder. After each load it asks the capture policy
(kernels/music3_graph_capture.py) about every graph unit, from its weights' type and residency: GGUF Q4_0/Q4_1/Q5_x/K-quant/
IQ4 weights, or weights kept in unpinned host memory without a dynamic-VRAM slot, mean no capture for that unit. Such
a unit's ``_v_block`` (what ``prefetch_queue_pop`` checks before it captures) reads None while the model is loaded,
so the unit runs eagerly; every other unit keeps its graph. ``--disable-cuda-graphs`` is never touched. Ejecting the
model restores ``_v_block``. Pinning the offending weights instead would not help GGUF (the host copies are the
dequantizer's shift tables, not the weights); for host-resident weights the GPU check measures both options.
"""

from __future__ import annotations

import inspect
import re

import torch

from ..contract import AttributeOverride, Fix, Retirement, State, Status, Target, log
from ..contract.comfy import is_music3_text_encoder
from ..kernels.music3_graph_capture import decide_unit

FIX_ID = "music3_graph_capture"
V_BLOCK_TEST = r'getattr\(module,\s*"_v_block",\s*None\)\s*is not None'
GRAPH_GATE = re.compile(r"enable_graph\s*=\s*enable_graph\b[^\n]*" + V_BLOCK_TEST)


def gates_capture_on_v_block(prefetch) -> bool:
    """Whether ``prefetch_queue_pop`` decides capture on the unit's ``_v_block``, in its own line or in a function of
    its module that it calls (a gate moved into a helper)."""
    pop = prefetch.prefetch_queue_pop
    if GRAPH_GATE.search(inspect.getsource(pop)):
        return True
    helpers = [getattr(prefetch, name) for name in pop.__code__.co_names if inspect.isfunction(getattr(prefetch, name,
                                                                                                      None))]
    return "enable_graph" in pop.__code__.co_varnames and any(
        re.search(V_BLOCK_TEST, inspect.getsource(helper)) for helper in helpers)


def graph_units(text_encoder) -> list[tuple]:
    """Each dynamic-VRAM unit of a Music 3 text encoder as its tuple of root modules (the first carries _v_block):
    from its units method, or, on a core that renamed or dropped it, each module the loader marked with ``_v_block``."""
    method = getattr(text_encoder, "get_dynamic_vram__units", None)
    if method is None:
        return [(module,) for module in text_encoder.modules() if getattr(module, "_v_block", None) is not None]
    units, last_units = method()
    return [tuple(unit) if isinstance(unit, (list, tuple)) else (unit,) for unit in (*units, *last_units)]


def compute_device(text_encoder) -> torch.device:
    """Where the loaded encoder computes: ComfyUI's load sets ``model.device``."""
    return torch.device(getattr(text_encoder, "device", None) or getattr(text_encoder, "execution_device", "cpu"))


class Music3GraphCapture(Fix):
    id = FIX_ID
    targets = (Target.CLIP,)
    retirement = Retirement(
        fixed_by="none known: a core whose graph capture skips units that copy from pageable host memory, or a GGUF "
                 "dequantizer without host-built shift tables (molbal/ComfyUI-GGUF#17)",
        delete_when="no supported core captures a Music 3 graph unit whose weights are GGUF Q4_0/K-quant or in "
                    "unpinned host memory")

    def detect(self) -> Status:
        try:
            import comfy.model_prefetch as prefetch
            import comfy.text_encoders.minimax_music as music
        except ImportError:
            return Status(State.NOT_APPLICABLE, "ComfyUI with MiniMax Music 3 CUDA graphs is not importable here")
        if not gates_capture_on_v_block(prefetch):
            return Status(State.FAILED, "comfy.model_prefetch.prefetch_queue_pop no longer gates graph capture on "
                                          "the unit's _v_block: the code drifted, fix left off")
        units = ("" if callable(getattr(music.MiniMaxMusic3TEModel, "get_dynamic_vram__units", None)) else
                 " (no get_dynamic_vram__units: units found by the loader's _v_block marks)")
        return Status(State.NEEDED, "Music 3 graph units are captured whatever their weights: a GGUF Q4_0/K-quant "
                                     "or host-resident unit fails capture (#16002)" + units)

    def hook_loaded_model(self, text_encoder) -> list:
        if not is_music3_text_encoder(text_encoder):
            return []
        device = compute_device(text_encoder)
        handles, refused, graphed = [], [], 0
        for roots in graph_units(text_encoder):
            if getattr(roots[0], "_v_block", None) is None:
                continue
            decision = decide_unit(roots, device)
            if decision.capture:
                graphed += 1
            else:
                handles.append(AttributeOverride(roots[0], "_v_block", None))
                refused.append(decision.reason)
        if refused:
            log.info("MiniMax Hotfix: %s: %d Music 3 graph unit(s) run without CUDA graph capture (%s); %d keep "
                     "their graphs", FIX_ID, len(refused), refused[0], graphed)
        return handles


FIX = Music3GraphCapture()
