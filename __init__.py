"""MiniMax Hotfix: device-placement fixes for MiniMax H3 and Music 3 in ComfyUI.

ComfyUI imports this file by path under a synthetic module name. Outside ComfyUI (tests, tools/doctor.py)
nothing here imports ComfyUI, so the pack's modules stay importable on a machine without it.

Inside ComfyUI the pack is also importable as ``minimax_hotfix``, so other custom nodes can call its public
function for transformers models they build themselves::

    import minimax_hotfix
    minimax_hotfix.attach_to_transformers_model(model)   # Qwen3-VL vision towers: pos-embed on the compute device
"""

import sys

try:
    import comfy.model_patcher  # noqa: F401  (present only inside ComfyUI)
except ImportError:
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}
else:
    from .api import attach_to_transformers_model, detach_from_transformers_model  # noqa: F401  (public)
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from .nodes.known_error_route import register_known_error_route
    from .nodes.prompt_fixing import register_prompt_fixing
    from .nodes.swap_route import register_swap_route
    from .registry import install_process_fixes

    sys.modules.setdefault("minimax_hotfix", sys.modules[__name__])
    install_process_fixes()
    register_swap_route()
    register_known_error_route()
    register_prompt_fixing()

WEB_DIRECTORY = "./web"  # the frontend extension (web/minimax_hotfix.js): swap menu entries and commands, known-error notices

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
