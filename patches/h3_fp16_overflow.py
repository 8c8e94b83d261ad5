"""h3_fp16_overflow: MiniMax H3 computes in fp16 without black frames, where the device has no bf16.

Bug: ComfyUI's H3 DiT (``comfy/ldm/minimax/model.py``) runs in its compute dtype throughout, and three of its
activations exceed fp16's 65504: ``condition_proj``'s output from the Qwen3-VL states (about 96k), the residual
stream's attention-sink rows (about 81k after the first block, about 4.3M after the fiftieth) and the attention
``out_proj`` / MLP ``fc2`` outputs (fc2 above 2M at some sigmas). In fp16 they become inf, then NaN: pure black
video and NaN audio, no error. H3 declares ``supported_inference_dtypes = [bfloat16, float32]``, so where ComfyUI
finds no bf16 (NVIDIA compute capability 7.x: V100, T4, RTX 20; AMD RDNA2 and older; Macs before macOS 14; Intel
XPU without bf16) it falls back to fp32, about 10 times slower than fp16; where the user forces fp16
(``--fp16-unet``, ``--force-fp16``, a ModelComputeDtype node) the output is black.

Upstream: Comfy-Org/ComfyUI #15262 (V100, closed as user support), #15315 (M4 Max ``--force-fp16``: black video,
NaN audio); deepbeepmeep/Wan2GP #2156 (RTX 2070: fp16 black, bf16 about 4x slower). No upstream fix.

Applies to: every core with ``comfy.ldm.minimax.model`` (0.33.0 and the 0.39 era checked).

Detection (behaviour, on a tiny H3 built from the running core's own classes): (1) the pack's fp32-stream block,
refiner and projection code, run in fp32, must give the model's own output bit for bit, and the blocks' forward must
take no argument the pack does not know: otherwise the DiT's code changed and the fix is "failed" and off; (2) a tiny
H3 whose activations leave fp16's range the way the real model's do is run in fp16 as the core runs it: where its
output is finite and matches the fp32 run, the core handles fp16 itself ("fixed upstream").

Off switch: ``MINIMAX_HOTFIX_DISABLE=h3_fp16_overflow`` (read on every DiT call, and by the loader's dtype choice).

Delete when: no supported core's tiny-H3 check overflows (every one reads "fixed upstream").

How (docs/h3_fp16_overflow.md): an injection (the pack's loader, Apply nodes, server-side fixing, raylight's actors)
gives the DiT instance attributes, inert unless the call computes in fp16 (kernels/h3_fp16.py): ``forward`` and
``preprocess_text_embeds`` mark an fp16 call; ``condition_proj`` computes in fp32, the refiner and blocks carry the
residual in fp32 with fp16 branches, hooks on ``out_proj`` / ``fc1`` rescale branch outputs by a power of two; a
safety net reads each fp16 call's finiteness once and runs a call past the rescale again in fp32 (``SafetyNet``).
In bf16 and fp32 every override calls the model's own code. ``choose_fp16`` lets ComfyUI compute H3 in fp16 where
it alone picks fp32 for want of bf16 and fp16 is fast (``fp16_instead_of_fp32``), on the pack's own patcher (the
loader's, or an Apply node's clone, never the patcher another loader caches); ``--fp32-unet`` keeps fp32.
"""

from __future__ import annotations

import inspect

import torch

from ..contract import AttributeOverride, Fix, Retirement, State, Status, Target, error_line, log, remove_handles
from ..contract.comfy import PromptRecord, checkpoint_compute_dtype, compute_dtype, fp16_instead_of_fp32
from ..kernels.h3_fp16 import (
    DIT_PARTS,
    fp32_stream_forwards,
    is_h3_dit,
    rescale_hooks,
    tiny_h3_model,
    tiny_h3_outputs,
)

FIX_ID = "h3_fp16_overflow"
BLOCK_ARGUMENTS = frozenset({"x", "t_emb", "mod_segments", "rope_freqs", "transformer_options", "attention"})


def hook_dit(dit, fix: H3Fp16Overflow, net: bool = True) -> list:
    """``fix`` on one H3 DiT instance, for its fp16 calls (none while its off switch is set), with its safety net
    (``net``; the benchmark measures the fix without it too); returns removable handles."""
    forwards = fp32_stream_forwards(dit, fix.link.switched_off, fix.net if net else None)
    overrides = [AttributeOverride(*override) for override in forwards]
    return overrides + rescale_hooks(dit)


class SafetyNet(PromptRecord):
    """What the safety net did (``PromptRecord``): the log says once per prompt which call tripped first."""

    def tripped(self, name: str, inputs: dict) -> None:
        first, prompt = self.repaired()
        if first:
            timestep = inputs.get("timestep")
            call = (f"DiT call at sigma {float(timestep.flatten()[0]) / 1000.0:.4g}"
                    if isinstance(timestep, torch.Tensor) else f"{name} call")
            log.warning("MiniMax Hotfix: %s: a MiniMax H3 %s left float16's range even with the branch rescale "
                        "(non-finite output): it ran again in float32, as will any other call that trips in this "
                        "prompt%s", FIX_ID, call, f" ({prompt})" if prompt else "")

    def summary(self) -> str:
        checked, tripped = self.counts()
        if not checked:
            return "safety net: no float16 MiniMax H3 call checked yet"
        if not tripped:
            return f"safety net: did not trip in the last run ({checked} float16 DiT call(s) checked)"
        return f"safety net: tripped in the last run: {tripped} of {checked} DiT call(s) ran again in float32"


def h3_dits(model) -> list:
    """The H3 DiTs in a loaded ComfyUI model (its ``diffusion_model``, or ``model`` itself)."""
    found = getattr(model, "diffusion_model", model)
    return [found] if isinstance(found, torch.nn.Module) and is_h3_dit(found) else []


def choose_fp16(patcher) -> bool:
    """Make an H3 that ComfyUI computes in fp32 for want of bf16 compute in fp16 (``fp16_instead_of_fp32``), by the
    patcher's own switch (an object patch, as ComfyUI's ModelComputeDtype node sets it); returns whether it did."""
    dits = h3_dits(patcher.model)
    if not dits or compute_dtype(patcher) != torch.float32:
        return False
    device = patcher.load_device
    if not fp16_instead_of_fp32(device, sum(p.numel() for p in dits[0].parameters())):
        return False
    patcher.set_model_compute_dtype(torch.float16)
    log.info("MiniMax Hotfix: %s: MiniMax H3 computes in float16 on %s (no bfloat16 here; ComfyUI alone computes it "
             "in float32), its overflow sites in float32", FIX_ID, device)
    return True


def comfyui_compute_dtype(device) -> torch.dtype:
    """The dtype ComfyUI alone computes MiniMax H3 in on ``device`` (a bfloat16 file, as released)."""
    import comfy.supported_models

    config = getattr(comfy.supported_models, "MiniMaxH3", None)
    supported = list(getattr(config, "supported_inference_dtypes", None) or (torch.bfloat16, torch.float32))
    return checkpoint_compute_dtype(device, supported, torch.bfloat16)


def loader_paths(device) -> tuple[str, bool]:
    """Which dtype MiniMax H3 computes in on ``device`` through the stock loaders (ComfyUI's choice) and through the
    pack's (``choose_fp16``), as one line, and whether the loader path matters there (forced fp16, or no bf16)."""
    stock = comfyui_compute_dtype(device)
    pack = torch.float16 if stock == torch.float32 and fp16_instead_of_fp32(device) else stock
    stock_name, pack_name = (str(dtype).removeprefix("torch.") for dtype in (stock, pack))
    paths = "the pack's loader, the Apply node and server-side fixing"
    if stock == pack != torch.float16:
        return f"MiniMax H3 computes in {stock_name} on {device} through every loader (stock and {paths})", False
    meaning = "video black, audio NaN" if stock == torch.float16 else "no bfloat16 here: correct, about 10 times " \
                                                                      "slower than float16"
    return (f"MiniMax H3 computes on {device} in {stock_name} through the stock loaders ({meaning}); in {pack_name} "
            f"through {paths}, its overflow sites in float32 and a float32 safety net"), True


def machine_note() -> str | None:
    """The start-up line, where the loader path decides how H3 computes on this machine."""
    import comfy.model_management as mm

    line, matters = loader_paths(mm.get_torch_device())
    return line if matters else None


def h3_model_class():
    """ComfyUI's H3 DiT class (``MiniMaxH3Model``, or on a core that renamed it the class of
    ``comfy.ldm.minimax.model`` with a ``_forward`` whose constructor builds ``condition_proj``); None where this
    core has no H3 DiT module, False where the module has no such class."""
    try:
        import comfy.ldm.minimax.model as dit_module
    except ImportError:
        return None
    return next((value for value in vars(dit_module).values() if inspect.isclass(value)
                 and value.__module__ == dit_module.__name__ and issubclass(value, torch.nn.Module)
                 and "_forward" in vars(value) and "condition_proj" in inspect.getsource(value.__init__)), False)


class H3Fp16Overflow(Fix):
    id = FIX_ID
    targets = (Target.MODEL,)
    retirement = Retirement(
        fixed_by="none yet: a core whose H3 DiT keeps condition_proj, the residual stream and the branch outputs "
                 "inside fp16's range (or in fp32) when it computes in fp16",
        delete_when="every supported core reads 'fixed upstream' here (its tiny H3 computes in fp16 without "
                    "overflow)")

    def detect(self) -> Status:
        model_class = h3_model_class()
        if model_class is None:
            return Status(State.NOT_APPLICABLE, "ComfyUI's MiniMax H3 DiT (comfy.ldm.minimax.model) is not "
                                                "importable here")
        if not model_class:
            return Status(State.FAILED, "comfy.ldm.minimax.model has no DiT class with condition_proj and _forward: "
                                        "the DiT changed, fix left off")
        import comfy.ops

        ops = comfy.ops.disable_weight_init
        try:
            reference = tiny_h3_model(model_class, ops, torch.float32, overflow=False)
            if not is_h3_dit(reference):
                return Status(State.FAILED, f"{model_class.__name__} no longer has {', '.join(DIT_PARTS)}: the DiT "
                                            "changed, fix left off")
            unknown = set(inspect.signature(reference.blocks[0].forward).parameters) - BLOCK_ARGUMENTS
            if unknown:
                return Status(State.FAILED, f"the DiT blocks' forward takes {', '.join(sorted(unknown))}, which the "
                                            "fix does not know: the DiT changed, fix left off")
            stock = tiny_h3_outputs(reference, torch.float32)
            handles = hook_dit(reference, self)
            try:
                streamed = tiny_h3_outputs(reference, torch.float32, stream_compute=torch.float32)
            finally:
                remove_handles(handles)
            if not torch.equal(stock, streamed):
                return Status(State.FAILED, "the fix's fp32-stream blocks no longer compute what the DiT's own blocks "
                                            "do (the DiT changed): fix left off")
            wanted = tiny_h3_outputs(tiny_h3_model(model_class, ops, torch.float32, overflow=True), torch.float32)
            in_fp16 = tiny_h3_outputs(tiny_h3_model(model_class, ops, torch.float16, overflow=True), torch.float16)
        except Exception as exc:
            return Status(State.FAILED, f"the DiT changed: the tiny H3 check failed ({error_line(exc)}); fix left "
                                        "off")
        if bool(torch.isfinite(in_fp16).all()) and torch.allclose(in_fp16, wanted, rtol=0.05, atol=0.05):
            return Status(State.FIXED_UPSTREAM, "this core's H3 computes in fp16 without overflow")
        return Status(State.NEEDED, "H3's condition_proj, residual stream and branch outputs exceed fp16's range: "
                                     "in fp16 the output is NaN (black video, NaN audio)")

    def __init__(self):
        self.net = SafetyNet()

    def hook_loaded_model(self, model) -> list:
        return [handle for dit in h3_dits(model) for handle in hook_dit(dit, self)]

    def on_own_patcher(self, patcher) -> None:
        choose_fp16(patcher)

    def machine_note(self) -> str | None:
        return machine_note()

    def machine_lines(self) -> list[str]:
        import comfy.model_management as mm

        return [loader_paths(mm.get_torch_device())[0], self.net.summary()]


FIX = H3Fp16Overflow()
