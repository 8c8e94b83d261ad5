"""ComfyUI nodes. Imported only inside ComfyUI (it needs ComfyUI's ``nodes`` module).

The loaders subclass the stock loaders of the running ComfyUI, so widgets, options, defaults and outputs are
whatever that version has, and a swapped workflow keeps its widget values.
"""

from __future__ import annotations

import copy

import nodes as comfy_nodes

from .. import registry
from ..registry.contract import Target, log

CATEGORY = "MiniMax Hotfix"


def _patcher(target: Target, obj):
    return obj if target is Target.MODEL else obj.patcher


def _loaded_with_fixes(target: Target, loaded: tuple) -> tuple:
    registry.attach_fixes(_patcher(target, loaded[0]), target)
    return loaded


def _loader_description(stock) -> str:
    return (f"Loads exactly like the stock {stock.__name__}, then attaches the MiniMax Hotfix fixes that this ComfyUI "
            f"needs. {getattr(stock, 'DESCRIPTION', '')}").strip()


class MiniMaxHotfixVAELoader(comfy_nodes.VAELoader):
    CATEGORY = CATEGORY
    DESCRIPTION = _loader_description(comfy_nodes.VAELoader)

    def load_vae(self, *args, **kwargs):
        return _loaded_with_fixes(Target.VAE, super().load_vae(*args, **kwargs))


class MiniMaxHotfixCLIPLoader(comfy_nodes.CLIPLoader):
    CATEGORY = CATEGORY
    DESCRIPTION = _loader_description(comfy_nodes.CLIPLoader)

    def load_clip(self, *args, **kwargs):
        return _loaded_with_fixes(Target.CLIP, super().load_clip(*args, **kwargs))


class MiniMaxHotfixUNETLoader(comfy_nodes.UNETLoader):
    CATEGORY = CATEGORY
    DESCRIPTION = _loader_description(comfy_nodes.UNETLoader)

    def load_unet(self, *args, **kwargs):
        return _loaded_with_fixes(Target.MODEL, super().load_unet(*args, **kwargs))


class _ApplyFixes:
    """A pass-through node: the ``TARGET`` input in, a copy with the fixes attached out, which other branches of the
    graph do not see (MODEL/CLIP via clone(), VAE via a new patcher)."""

    TARGET: Target
    IO_TYPE: str
    FUNCTION = "apply"
    CATEGORY = CATEGORY

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {cls.TARGET.value: (cls.IO_TYPE,)}}

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
        registry.attach_fixes(_patcher(self.TARGET, fixed), self.TARGET)
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


class MiniMaxHotfixApplyCLIP(_ApplyFixes):
    TARGET, IO_TYPE, RETURN_TYPES = Target.CLIP, "CLIP", ("CLIP",)
    DESCRIPTION = _apply_description("CLIP")


class MiniMaxHotfixApplyModel(_ApplyFixes):
    TARGET, IO_TYPE, RETURN_TYPES = Target.MODEL, "MODEL", ("MODEL",)
    DESCRIPTION = _apply_description("MODEL")


class MiniMaxHotfixStatus:
    DESCRIPTION = "Shows, for this ComfyUI, each MiniMax Hotfix fix's state: needed (this core has the bug), fixed " \
                  "upstream, not applicable, not affected, failed (its import, detection or target code broke) or " \
                  "disabled (switched off by MINIMAX_HOTFIX_DISABLE); where it is attached (to how many loaded " \
                  "models, how many modules it hooked at the last load: a stock loader's model never counts); the " \
                  "reason; then, per fix, the upstream change that makes it obsolete and when its file can be deleted."
    CATEGORY = CATEGORY
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
    "MiniMaxHotfixStatus": "MiniMax Hotfix Status",
}
NODE_CLASS_MAPPINGS = {
    cls.__name__: cls
    for cls in (MiniMaxHotfixVAELoader, MiniMaxHotfixCLIPLoader, MiniMaxHotfixUNETLoader, MiniMaxHotfixApplyVAE,
                MiniMaxHotfixApplyCLIP, MiniMaxHotfixApplyModel, MiniMaxHotfixStatus)
}
