"""ComfyUI nodes. Imported only inside ComfyUI (it needs ComfyUI's ``nodes`` module).

The loaders subclass the stock loaders of the running ComfyUI, so widgets, options, defaults and outputs are
whatever that version has, and a swapped workflow keeps its widget values.
"""

from __future__ import annotations

import copy

import nodes as comfy_nodes

from .. import patches
from ..patches._report import status_table

CATEGORY = "MiniMax Hotfix"


def _patcher(target: str, obj):
    return obj if target == "model" else obj.patcher


def _fixed_loader(node_id: str, stock, target: str, display: str):
    """A subclass of a stock loader whose load function runs the stock one, then attaches the fixes."""

    def load(self, *args, **kwargs):
        loaded = getattr(stock, stock.FUNCTION)(self, *args, **kwargs)
        patches.attach_fixes(_patcher(target, loaded[0]), target)
        return loaded

    return type(
        node_id,
        (stock,),
        {
            stock.FUNCTION: load,
            "CATEGORY": CATEGORY,
            "DESCRIPTION": f"Loads exactly like the stock {stock.__name__}, then attaches the MiniMax Hotfix fixes "
            f"that this ComfyUI needs. {getattr(stock, 'DESCRIPTION', '')}".strip(),
        },
    ), display


def _copy_with_fixes(target: str, obj):
    """A copy that other branches of the graph do not see: MODEL/CLIP via clone(), VAE via a new patcher."""
    if target == "vae":
        fixed = copy.copy(obj)
        fixed.patcher = obj.patcher.clone()
    else:
        fixed = obj.clone()
    patches.attach_fixes(_patcher(target, fixed), target)
    return fixed


def _apply_node(node_id: str, target: str, io_type: str):
    """A pass-through node: ``target`` input in, the same object with the fixes attached out."""

    def apply(self, **inputs):
        return (_copy_with_fixes(target, inputs[target]),)

    return type(
        node_id,
        (),
        {
            "INPUT_TYPES": classmethod(lambda cls: {"required": {target: (io_type,)}}),
            "RETURN_TYPES": (io_type,),
            "FUNCTION": "apply",
            "CATEGORY": CATEGORY,
            "DESCRIPTION": f"Attaches the MiniMax Hotfix fixes to a {io_type} from any loader (GGUF and other "
            "third-party loaders included). The input object itself is left unchanged.",
            "apply": apply,
        },
    )


class MiniMaxHotfixStatus:
    DESCRIPTION = "Shows, for this ComfyUI, each MiniMax Hotfix fix: applied, fixed upstream, not applicable, " \
                  "not affected, failed (its import, detection or target code broke) or disabled (switched off by " \
                  "MINIMAX_HOTFIX_DISABLE), with the reason."
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
        table = status_table()
        return {"ui": {"text": [table]}, "result": (table,)}


_LOADERS = [
    _fixed_loader("MiniMaxHotfixVAELoader", comfy_nodes.VAELoader, "vae", "Load VAE (MiniMax Hotfix)"),
    _fixed_loader("MiniMaxHotfixCLIPLoader", comfy_nodes.CLIPLoader, "clip", "Load CLIP (MiniMax Hotfix)"),
    _fixed_loader("MiniMaxHotfixUNETLoader", comfy_nodes.UNETLoader, "model", "Load Diffusion Model (MiniMax Hotfix)"),
]
_APPLIERS = [
    (_apply_node("MiniMaxHotfixApplyVAE", "vae", "VAE"), "Apply MiniMax Hotfix (VAE)"),
    (_apply_node("MiniMaxHotfixApplyCLIP", "clip", "CLIP"), "Apply MiniMax Hotfix (CLIP)"),
    (_apply_node("MiniMaxHotfixApplyModel", "model", "MODEL"), "Apply MiniMax Hotfix (MODEL)"),
]
_ALL = _LOADERS + _APPLIERS + [(MiniMaxHotfixStatus, "MiniMax Hotfix Status")]

NODE_CLASS_MAPPINGS = {cls.__name__: cls for cls, _ in _ALL}
NODE_DISPLAY_NAME_MAPPINGS = {cls.__name__: display for cls, display in _ALL}
