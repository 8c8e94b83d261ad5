"""The pack's own pure modules where the pack is not loaded: in a ComfyUI server without it, the GGUF stand-in
(tests/comfyui_gguf_stand_in) and the test probe run the pack's Q4_0 dequantization and emulated capture rules, the
same code its tests run. They load under a package of their own whose ``__init__`` never runs, so nothing of the pack
registers itself with that server. Standard library only."""

import importlib
import sys
import types
from pathlib import Path

PACKAGE = "minimax_hotfix_pure_modules"


def pack_module(name: str):
    """The pack's module ``name`` (``diagnostics.emulated_capture``): only modules whose imports stay within pure
    modules of the pack (its kernels, its diagnostics' emulations, its contract)."""
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(Path(__file__).resolve().parents[2])]
        sys.modules[PACKAGE] = package
    return importlib.import_module(f"{PACKAGE}.{name}")
