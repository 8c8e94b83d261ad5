"""MiniMax Hotfix: device-placement fixes for MiniMax H3 and Music 3 in ComfyUI.

ComfyUI imports this file by path under a synthetic module name. Outside ComfyUI (tests, tools/doctor.py)
nothing here imports ComfyUI, so the pack's modules stay importable on a machine without it.
"""

try:
    import comfy.model_patcher  # noqa: F401  (present only inside ComfyUI)
except ImportError:
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}
else:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from .patches import install_process_fixes

    install_process_fixes()

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
