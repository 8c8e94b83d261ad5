"""ComfyUI nodes. Imported only inside ComfyUI (it needs ComfyUI's ``nodes`` module).

The loaders subclass the stock loaders of the running ComfyUI, so widgets, options, defaults and outputs are
whatever that version has, and a swapped workflow keeps its widget values.
"""

from __future__ import annotations

import copy

import nodes as comfy_nodes

from .. import registry
from ..contract import Target, log

CATEGORY = "MiniMax Hotfix"


def _patcher(target: Target, obj):
    return obj if target is Target.MODEL else obj.patcher


def _loaded_with_fixes(target: Target, loaded: tuple) -> tuple:
    registry.attach_fixes(_patcher(target, loaded[0]), target, own_patcher=True)
    return loaded


def _loader_description(stock) -> str:
    return (f"Loads exactly like the stock {stock.__name__}, then attaches the MiniMax Hotfix fixes that this ComfyUI "
            f"needs. {getattr(stock, 'DESCRIPTION', '')}").strip()


STOCK_INPUT_TOOLTIPS = {  # for the stock loaders' inputs, by input name; a core's own tooltip always wins
    "vae_name": "The VAE to load from models/vae: for MiniMax H3 its video VAE or its audio VAE, for Music 3 its VAE.",
    "clip_name": "The text encoder to load from models/text_encoders: MiniMax H3's Qwen3-VL encoder or Music 3's "
                 "text encoder.",
    "type": "The kind of text encoder; \"minimax\" for MiniMax H3 and Music 3.",
    "device": "Where the text encoder runs: \"default\" lets ComfyUI decide, \"cpu\" keeps it on the CPU.",
    "unet_name": "The diffusion model to load from models/diffusion_models: MiniMax H3's video model or Music 3's.",
    "weight_dtype": "The dtype the weights are kept in: \"default\" keeps the file's own; an fp8 type takes less "
                    "memory for some quality, and \"fp8_e4m3fn_fast\" also computes in fp8 where the GPU can.",
}


def _with_tooltips(stock_input_types: dict) -> dict:
    """The stock loader's inputs with the pack's tooltip added where the running core has none. Built anew, so the
    stock loader's own dicts stay untouched."""
    return {section: {name: _with_tooltip(name, entry) for name, entry in inputs.items()}
            for section, inputs in stock_input_types.items()}


def _with_tooltip(name: str, entry):
    if name not in STOCK_INPUT_TOOLTIPS:
        return entry
    options = entry[1] if len(entry) > 1 else {}
    if options.get("tooltip"):
        return entry
    return (entry[0], {**options, "tooltip": STOCK_INPUT_TOOLTIPS[name]}, *entry[2:])


class MiniMaxHotfixVAELoader(comfy_nodes.VAELoader):
    CATEGORY = CATEGORY
    DESCRIPTION = _loader_description(comfy_nodes.VAELoader)
    SEARCH_ALIASES = ["minimax vae", "load vae fix", "h3 vae", "music 3 vae", "vae device fix"]

    @classmethod
    def INPUT_TYPES(cls):
        return _with_tooltips(super().INPUT_TYPES())

    def load_vae(self, *args, **kwargs):
        return _loaded_with_fixes(Target.VAE, super().load_vae(*args, **kwargs))


class MiniMaxHotfixCLIPLoader(comfy_nodes.CLIPLoader):
    CATEGORY = CATEGORY
    DESCRIPTION = _loader_description(comfy_nodes.CLIPLoader)
    SEARCH_ALIASES = ["minimax clip", "load clip fix", "minimax text encoder", "h3 text encoder", "music 3 clip fix",
                      "qwen3-vl fix"]

    @classmethod
    def INPUT_TYPES(cls):
        return _with_tooltips(super().INPUT_TYPES())

    def load_clip(self, *args, **kwargs):
        return _loaded_with_fixes(Target.CLIP, super().load_clip(*args, **kwargs))


class MiniMaxHotfixUNETLoader(comfy_nodes.UNETLoader):
    CATEGORY = CATEGORY
    DESCRIPTION = _loader_description(comfy_nodes.UNETLoader)
    SEARCH_ALIASES = ["minimax unet", "minimax diffusion model", "load unet fix", "load diffusion model fix",
                      "h3 model", "music 3 model", "int8 fix"]

    @classmethod
    def INPUT_TYPES(cls):
        return _with_tooltips(super().INPUT_TYPES())

    def load_unet(self, *args, **kwargs):
        return _loaded_with_fixes(Target.MODEL, super().load_unet(*args, **kwargs))


class _ApplyFixes:
    """A pass-through node: the ``TARGET`` input in, a copy with the fixes attached out, which other branches of the
    graph do not see (MODEL/CLIP via clone(), VAE via a new patcher)."""

    TARGET: Target
    IO_TYPE: str
    INPUT_TOOLTIP: str
    FUNCTION = "apply"
    CATEGORY = CATEGORY

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {cls.TARGET.value: (cls.IO_TYPE, {"tooltip": cls.INPUT_TOOLTIP})}}

    def apply(self, **inputs):
        original = inputs[self.TARGET.value]
        if not _has_patcher(self.TARGET, original):
            log.warning("MiniMax Hotfix: %s got a %s, not a ComfyUI %s with a model patcher: passed on unchanged, "
                        "no fix attached", type(self).__name__, type(original).__name__, self.IO_TYPE)
            return (original,)
        if self.TARGET is Target.VAE:
            fixed = copy.copy(original)
            fixed.patcher = original.patcher.clone()
        else:
            fixed = original.clone()
        # the clone is the node's own: a choice made on it (H3's compute dtype) never reaches the loader's cached
        # patcher, which keeps ComfyUI's choice once the node is gone
        registry.attach_fixes(_patcher(self.TARGET, fixed), self.TARGET, own_patcher=True)
        return (fixed,)


PATCHER_METHODS = ("clone", "get_injections", "set_injections", "remove_injections")


def _has_patcher(target: Target, obj) -> bool:
    """Whether ``obj`` carries the ComfyUI patcher the fixes attach to (a third-party node may hand on anything)."""
    patcher = obj if target is Target.MODEL else getattr(obj, "patcher", None)
    clones = obj if target is Target.CLIP else patcher
    return all(callable(getattr(patcher, name, None)) for name in PATCHER_METHODS) and callable(
        getattr(clones, "clone", None))


def _apply_description(io_type: str) -> str:
    return (f"Attaches the MiniMax Hotfix fixes to a {io_type} from any loader (GGUF and other third-party loaders "
            "included). The input object itself is left unchanged.")


class MiniMaxHotfixApplyVAE(_ApplyFixes):
    TARGET, IO_TYPE, RETURN_TYPES = Target.VAE, "VAE", ("VAE",)
    DESCRIPTION = _apply_description("VAE")
    INPUT_TOOLTIP = "The VAE to attach the fixes to, from any loader; the output is a copy with the fixes."
    SEARCH_ALIASES = ["minimax vae fix", "fix vae", "vae device fix"]


class MiniMaxHotfixApplyCLIP(_ApplyFixes):
    TARGET, IO_TYPE, RETURN_TYPES = Target.CLIP, "CLIP", ("CLIP",)
    DESCRIPTION = _apply_description("CLIP")
    INPUT_TOOLTIP = ("The text encoder to attach the fixes to, from any loader (a GGUF one too); the output is a copy "
                     "with the fixes.")
    SEARCH_ALIASES = ["minimax clip fix", "fix clip", "gguf clip fix", "music 3 clip fix", "minimax text encoder fix"]


class MiniMaxHotfixApplyModel(_ApplyFixes):
    TARGET, IO_TYPE, RETURN_TYPES = Target.MODEL, "MODEL", ("MODEL",)
    DESCRIPTION = _apply_description("MODEL")
    INPUT_TOOLTIP = ("The diffusion model to attach the fixes to, from any loader (GGUF, checkpoint, third-party); the "
                     "output is a copy with the fixes.")
    SEARCH_ALIASES = ["minimax model fix", "fix model", "gguf model fix", "int8 fix"]


class MiniMaxHotfixApplyRayActors:
    DESCRIPTION = ("Attaches the MiniMax Hotfix model fixes in every Ray actor of raylight's multi-GPU loader "
                   "(RayUNETLoader, RayGGUFLoader): each actor builds its own MiniMax H3, which the other Apply nodes "
                   "never reach; the fp16 choice is made on each actor's own GPU. Put it right after the loader.")
    CATEGORY = CATEGORY
    SEARCH_ALIASES = ["raylight fix", "ray actors fix", "multi gpu minimax fix", "minimax h3 multi gpu"]
    RETURN_TYPES = ("RAY_ACTORS",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"ray_actors": ("RAY_ACTORS", {
            "tooltip": "raylight's actors from its diffusion-model loader; the output is the same actors, each "
                       "actor's model with the fixes attached."})}}

    def apply(self, ray_actors):
        from ..registry.ray_actors import attach_in_every_actor  # imports Ray on the node's first run only

        attach_in_every_actor(ray_actors)
        return (ray_actors,)


class MiniMaxHotfixStatus:
    DESCRIPTION = "Shows, for this ComfyUI, each MiniMax Hotfix fix's state: needed (this core has the bug), fixed " \
                  "upstream, not applicable, not affected, failed (its import, detection or target code broke) or " \
                  "disabled (switched off by MINIMAX_HOTFIX_DISABLE); where it is attached (to how many loaded " \
                  "models, how many modules it hooked at the last load: a stock loader's model never counts); the " \
                  "reason; then, per fix, the upstream change that makes it obsolete and when its file can be deleted."
    CATEGORY = CATEGORY
    SEARCH_ALIASES = ["minimax status", "hotfix status", "fix status", "minimax doctor"]
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)
    FUNCTION = "report"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    @classmethod
    def IS_CHANGED(cls):
        return float("nan")  # the off switch and upstream state can change between runs

    def report(self):
        from ..registry.status_table import status_table  # imported on the node's first run, not at start-up

        table = status_table()
        return {"ui": {"text": [table]}, "result": (table,)}


NODE_DISPLAY_NAME_MAPPINGS = {
    "MiniMaxHotfixVAELoader": "Load VAE (MiniMax Hotfix)",
    "MiniMaxHotfixCLIPLoader": "Load CLIP (MiniMax Hotfix)",
    "MiniMaxHotfixUNETLoader": "Load Diffusion Model (MiniMax Hotfix)",
    "MiniMaxHotfixApplyVAE": "Apply MiniMax Hotfix (VAE)",
    "MiniMaxHotfixApplyCLIP": "Apply MiniMax Hotfix (CLIP)",
    "MiniMaxHotfixApplyModel": "Apply MiniMax Hotfix (MODEL)",
    "MiniMaxHotfixApplyRayActors": "Apply MiniMax Hotfix (Ray actors)",
    "MiniMaxHotfixStatus": "MiniMax Hotfix Status",
}
NODE_CLASS_MAPPINGS = {
    cls.__name__: cls
    for cls in (MiniMaxHotfixVAELoader, MiniMaxHotfixCLIPLoader, MiniMaxHotfixUNETLoader, MiniMaxHotfixApplyVAE,
                MiniMaxHotfixApplyCLIP, MiniMaxHotfixApplyModel, MiniMaxHotfixApplyRayActors, MiniMaxHotfixStatus)
}
