"""Reaching ComfyUI without depending on it: inside ComfyUI its modules are already imported; from the doctor or the
tests, ``diagnostics/comfyui_checkout.py`` puts a checkout named by COMFYUI_PATH on the path first. The fixes and
these helpers import ComfyUI's modules plainly (inside the functions that need them, ``except ImportError`` where
the doctor or the tests may run without ComfyUI), so that breakage tools reading imports (comfy-import-guard) see
what each fix reaches; ``comfy_module`` serves the diagnostics, which ask for modules by name."""

from __future__ import annotations

import importlib
import inspect
import threading

import torch


def comfy_module(name: str):
    """The ComfyUI module ``name`` (e.g. "comfy.ldm.minimax.vae"), or None where ComfyUI or the module is absent."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def is_music3_text_encoder(model) -> bool:
    """Whether ``model`` is ComfyUI's MiniMax Music 3 text encoder (its AR model); False where ComfyUI lacks it."""
    try:
        from comfy.ldm.minimax_music.ar import MiniMaxMusic3AR
    except ImportError:
        return False
    return isinstance(model, MiniMaxMusic3AR)


def qwen3vl_tower_class():
    """ComfyUI's Qwen3.5/Qwen3-VL vision tower class (``Qwen35VisionModel``, or on a core that renamed it the one
    class of ``comfy.text_encoders.qwen35`` that builds both its tables), or None where this core lacks it."""
    return _qwen35_class("Qwen35VisionModel", lambda cls: {"rot_pos_emb", "fast_pos_embed_interpolate"} <= set(vars(cls)))


def qwen3vl_rotary_class():
    """The vision tower's rotary embedding class (``Qwen35VisionRotaryEmbedding``, or on a core that renamed it the
    one class of ``comfy.text_encoders.qwen35`` whose forward builds a table from ``inv_freq``), or None."""
    return _qwen35_class("Qwen35VisionRotaryEmbedding", lambda cls: "forward" in vars(cls) and "inv_freq" in getattr(
        vars(cls)["forward"], "__code__", None).co_names)


def _qwen35_class(name: str, recognised):
    try:
        import comfy.text_encoders.qwen35 as qwen35
    except ImportError:
        return None
    if hasattr(qwen35, name):
        return getattr(qwen35, name)
    found = [value for value in vars(qwen35).values() if inspect.isclass(value) and value.__module__ == qwen35.__name__
             and recognised(value)]
    return found[0] if len(found) == 1 else None


def running_prompt() -> str | None:
    """The id of the prompt ComfyUI is executing in this thread (None outside one, or on a core without it)."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None
    return getattr(get_executing_context(), "prompt_id", None)


class PromptRecord:
    """A fix's calls per prompt ComfyUI runs: how many it checked and how many it repaired in the last prompt, for the
    Status node, and whether a repair is the prompt's first, for one log line per prompt. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._prompt: object = None
        self._checked = self._repaired = 0

    def checked(self) -> None:
        prompt = running_prompt()
        with self._lock:
            if prompt != self._prompt:
                self._prompt, self._checked, self._repaired = prompt, 0, 0
            self._checked += 1

    def repaired(self) -> tuple[bool, object]:
        """Counts a repair of the last checked call: (whether it is the prompt's first, the prompt's id)."""
        with self._lock:
            self._repaired += 1
            return self._repaired == 1, self._prompt

    def counts(self) -> tuple[int, int]:
        """(calls checked, calls repaired) in the last prompt."""
        with self._lock:
            return self._checked, self._repaired


def fp16_is_fast(device) -> bool:
    """Whether ``device`` computes fp16 at full rate: on NVIDIA, compute capability 7.0 or newer (Pascal's 6.x runs
    fp16 at 1/64 of fp32 on consumer cards); other accelerators are taken at ComfyUI's word."""
    if getattr(device, "type", None) == "cuda" and torch.version.cuda and not torch.version.hip:
        return torch.cuda.get_device_capability(device)[0] >= 7
    return True


def fp16_instead_of_fp32(device, params: int = 0) -> bool:
    """Whether a model ComfyUI computes in fp32 on ``device`` for want of bf16 could compute in fp16 there: ComfyUI's
    own ``should_use_fp16`` says yes and ``should_use_bf16`` says no (the only reason it picked fp32), the device runs
    fp16 at full rate, and the user did not force fp32 (``--fp32-unet``; ``--force-fp32`` makes ComfyUI say no)."""
    import comfy.model_management as mm
    from comfy.cli_args import args

    return (not args.fp32_unet and fp16_is_fast(device) and mm.should_use_fp16(device, model_params=params)
            and not mm.should_use_bf16(device, model_params=params))


def compute_dtype(patcher) -> torch.dtype:
    """The dtype ``patcher``'s model computes in, its object patches counted (ComfyUI's ModelComputeDtype node, or a
    choice the pack made, sets ``manual_cast_dtype`` on the patcher, not on the model its clones share)."""
    manual_cast = patcher.get_model_object("manual_cast_dtype")
    return manual_cast if manual_cast is not None else patcher.model.get_dtype()


def checkpoint_compute_dtype(device, supported: list, weight: torch.dtype) -> torch.dtype:
    """The dtype ComfyUI alone computes a diffusion model in on ``device``, by its own rules, for a model whose
    supported inference dtypes are ``supported`` and whose file holds ``weight``: ``unet_dtype``, then
    ``unet_manual_cast``."""
    import comfy.model_management as mm

    chosen = mm.unet_dtype(device, supported_dtypes=supported, weight_dtype=weight)
    return mm.unet_manual_cast(chosen, device, supported) or chosen
