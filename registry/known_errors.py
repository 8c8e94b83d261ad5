"""The errors the pack's fixes repair, as ComfyUI reports them, and what the pack says when a prompt fails with one.

``KNOWN_ERRORS`` is the one list of them: the browser extension asks ``POST /minimax_hotfix/known_error``
(nodes/known_error_route.py), which answers with ``explain``; ``python tools/doctor.py --explain`` matches a pasted
error with ``known_error``; and tests/test_known_errors.py checks every entry against the README's troubleshooting
section it names, and every error heading there against the entries. An entry matches when the exception message
holds one of its ``message`` texts and the traceback every one of its ``traceback`` texts (paths with ``/``): where two
fixes share a message, the file or function the error passes through tells them apart, so the first matching entry
wins and the more specific entries come first.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from ..contract import State
from ..swap_loaders import api_model_sources
from . import attachment, fix_named, status

DOCTOR = "python tools/doctor.py"


class Remedy(str, enum.Enum):
    """How a user gets the fix: ``LOADERS``: the model goes through the pack (its loader instead of the stock one, or
    an Apply node after any other loader); ``PROCESS_WIDE``: the fix installs itself when ComfyUI loads the pack, so
    the error means it is off or no longer repairs it; ``CUSTOM_NODE``: the custom node that builds the model calls
    ``minimax_hotfix.attach_to_transformers_model`` (no workflow change reaches such a model)."""

    LOADERS = "loaders"
    PROCESS_WIDE = "process-wide"
    CUSTOM_NODE = "custom node"


class KnownError(NamedTuple):
    fix: str
    readme: str  # the README troubleshooting heading that explains it: the text of the heading's first code span
    message: tuple[str, ...]  # the exception message holds one of these
    traceback: tuple[str, ...]  # and the traceback holds all of these
    explanation: str  # one sentence: what went wrong
    remedy: Remedy
    models: tuple[str, ...] = ()  # LOADERS: the ComfyUI types of the models whose loaders the remedy concerns


MIXED_DEVICES = "Expected all tensors to be on the same device"
VAE_HEADING = "Expected all tensors to be on the same device, but got weight is on cpu ... (wrapper_CUDA___fused_rms_norm)"
STATIC_CACHE_HEADING = "found at least two devices, cuda:0 and cpu"
INT8_HEADING = "NotImplementedError: The operator 'aten::_int_mm' is not currently implemented for the MPS device."
INT8_MESSAGE = ("The operator 'aten::_int_mm' is not currently implemented",)
INT8_EXPLANATION = ("this ComfyUI sends the model's int8 layers to torch._int_mm, which this device (Apple Silicon, "
                    "torch before 2.15) does not have.")

# cuBLASLt refusing an int8 GEMM on NVIDIA compute capability 7.0 (V100, Titan V: no int8 tensor cores), which
# ComfyUI's supports_int8_compute still says yes to; the same message for an fp8 or a per-row scaled GEMM elsewhere
# does not pass through torch._int_mm
VOLTA_INT8_HEADING = "RuntimeError: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul ... (int8 on a V100)"
VOLTA_INT8_MESSAGE = ("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul",)
VOLTA_INT8_EXPLANATION = ("this ComfyUI sends the model's int8 layers to torch._int_mm, which cuBLASLt refuses on this "
                          "GPU (compute capability 7.0, V100 or Titan V: no int8 tensor cores).")

KNOWN_ERRORS = (
    KnownError("vae_qk_norm_scale", VAE_HEADING, (MIXED_DEVICES,), ("comfy/ldm/minimax/vae.py",),
               "MiniMax H3's video VAE was loaded partly, and this ComfyUI (0.36/0.37) leaves its attention buffer "
               "qk_norm_scale on the CPU.", Remedy.LOADERS, ("VAE",)),
    KnownError("transformers_qwen3vl_pos_embed",
               "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
               (MIXED_DEVICES, "is not on the expected device"), ("modeling_qwen3_vl", "pos_embed"),
               "a transformers Qwen3-VL vision tower found its position table on another device than its input.",
               Remedy.CUSTOM_NODE),
    KnownError("transformers_static_cache", STATIC_CACHE_HEADING,
               ("found at least two devices", "attn_bias is on cpu"), ("transformers/generation/",),
               "transformers 5.13.1-5.19.0 leaves the attention masks of a static cache on the CPU.",
               Remedy.PROCESS_WIDE),
    KnownError("transformers_static_cache", STATIC_CACHE_HEADING, ("Incompatible shapes for broadcasting",),
               ("transformers/generation/",),
               "transformers' static cache under tensor parallelism with prefill_chunk_size keeps every KV head on "
               "each rank.", Remedy.PROCESS_WIDE),
    KnownError("ck_rope_device", VAE_HEADING, (MIXED_DEVICES,), ("comfy_kitchen/",),
               "a comfy-kitchen rope kernel got its scale or rotation table on the CPU.", Remedy.PROCESS_WIDE),
    KnownError("int8_full_precision_mm", INT8_HEADING, INT8_MESSAGE, ("comfy/ldm/minimax/vae.py",),
               f"at VAE Decode: {INT8_EXPLANATION}", Remedy.LOADERS, ("VAE",)),
    KnownError("int8_full_precision_mm", INT8_HEADING, INT8_MESSAGE, ("comfy/text_encoders/",),
               f"in the text encoder: {INT8_EXPLANATION}", Remedy.LOADERS, ("CLIP",)),
    KnownError("int8_full_precision_mm", INT8_HEADING, INT8_MESSAGE, (),
               f"in the diffusion model: {INT8_EXPLANATION}", Remedy.LOADERS, ("MODEL",)),
    KnownError("int8_full_precision_mm", VOLTA_INT8_HEADING, VOLTA_INT8_MESSAGE, ("_int_mm", "comfy/ldm/minimax/vae.py"),
               f"at VAE Decode: {VOLTA_INT8_EXPLANATION}", Remedy.LOADERS, ("VAE",)),
    KnownError("int8_full_precision_mm", VOLTA_INT8_HEADING, VOLTA_INT8_MESSAGE, ("_int_mm", "comfy/text_encoders/"),
               f"in the text encoder: {VOLTA_INT8_EXPLANATION}", Remedy.LOADERS, ("CLIP",)),
    KnownError("int8_full_precision_mm", VOLTA_INT8_HEADING, VOLTA_INT8_MESSAGE, ("_int_mm",),
               f"in the diffusion model: {VOLTA_INT8_EXPLANATION}", Remedy.LOADERS, ("MODEL",)),
    KnownError("cpu_device_cuda_query", "ValueError: Expected a cuda device, but got: cpu",
               ("Expected a cuda device, but got: cpu",), (),
               "ComfyUI keeps the text encoder on the CPU of this NVIDIA machine, then asks CUDA about that CPU.",
               Remedy.PROCESS_WIDE),
    KnownError("music3_graph_capture",
               "RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor "
               "is pinned.", ("Cannot copy between CPU and CUDA tensors during CUDA graph capture",), (),
               "MiniMax Music 3's CUDA graph capture met text encoder weights that dynamic VRAM keeps in host memory.",
               Remedy.LOADERS, ("CLIP",)),
)


def known_error(message: str, traceback: str = "") -> KnownError | None:
    """The first entry of ``KNOWN_ERRORS`` that ``message`` and ``traceback`` (any path separators) match, or None."""
    traceback = traceback.replace("\\", "/")
    return next((entry for entry in KNOWN_ERRORS
                 if any(text in message for text in entry.message)
                 and all(text in traceback for text in entry.traceback)), None)


MODEL_WORDS = {"VAE": "VAE", "CLIP": "text encoder", "MODEL": "diffusion model"}


def _state_line(entry: KnownError) -> str:
    """The fix's state and attachment in this process, and what to do next."""
    fix = fix_named(entry.fix)
    if fix is None:
        return f"MiniMax Hotfix's {entry.fix} repairs it, but its module failed to import here: run {DOCTOR} and " \
               "report its output."
    found = status(fix)
    said = f"MiniMax Hotfix's {entry.fix} repairs it; here it is {found.state.value} ({found.reason}), {attachment(fix)}."
    if found.state is State.DISABLED:
        return f"{said} Take it out of MINIMAX_HOTFIX_DISABLE and restart ComfyUI."
    return f"{said} The fix may have drifted, or this is a new bug: run {DOCTOR} --fix {entry.fix} and report its output."


def explain(error: dict, prompt: dict, output_types: Callable[[str], Sequence[str]], stock_loaders: Iterable[str],
            apply_node: dict[str, str]) -> dict | None:
    """What the extension says about ComfyUI's ``execution_error`` ``error`` (its node_id, node_type,
    exception_message and traceback, a list of lines) in the API-format ``prompt`` that failed, or None for an error no
    fix repairs. A ``prompt`` without that node (the workflow was edited since) leaves the error alone to judge.
    ``stock_loaders``: the node types the pack's swap replaces; ``apply_node``: the Apply node type per model type.

    ``action``: "fix_workflow" (the pack's swap puts the failing model through the pack), "insert_apply" (the model
    comes from one loader the swap does not replace: ``node``, after which ``apply`` goes), "report" (the model
    already goes through the pack, or the fix is process-wide or not needed here: ``text`` gives its state and what
    to do next), or "custom_node" (a model only the custom node that builds it can hand to the pack).
    """
    entry = known_error(str(error.get("exception_message", "")), "".join(error.get("traceback") or []))
    if entry is None:
        return None
    said = f"A known bug ({entry.fix}): {entry.explanation}"
    reply = {"fix": entry.fix, "readme": entry.readme, "node": None, "apply": None}
    if entry.remedy is Remedy.CUSTOM_NODE:
        return {**reply, "action": "custom_node",
                "text": f"{said} The custom node that loads this model must pass it to "
                        "minimax_hotfix.attach_to_transformers_model(model) (README, Troubleshooting)."}
    fix = fix_named(entry.fix)
    node_id = str(error.get("node_id"))
    ran_this = node_id in prompt and prompt[node_id]["class_type"] == error.get("node_type")
    through_pack, loaders = api_model_sources(prompt, node_id, entry.models, output_types) if ran_this else ([], [])
    if entry.remedy is Remedy.PROCESS_WIDE or fix is None or status(fix).state is not State.NEEDED \
            or (through_pack and not loaders):
        return {**reply, "action": "report", "text": f"{said} {_state_line(entry)}"}
    if len(loaders) == 1 and prompt[loaders[0]]["class_type"] not in set(stock_loaders):
        (loader,) = loaders
        model = sorted(set(entry.models) & set(output_types(prompt[loader]["class_type"])))[0]
        return {**reply, "action": "insert_apply", "node": loader, "apply": apply_node[model],
                "text": f"{said} {apply_node[model]} after {prompt[loader]['class_type']} attaches the fix."}
    models = " and ".join(MODEL_WORDS[model] for model in entry.models)
    return {**reply, "action": "fix_workflow",
            "text": f"{said} Fix this workflow loads the {models} through the pack, which attaches the fix."}
