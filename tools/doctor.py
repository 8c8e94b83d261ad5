"""The pack's doctor: environment, each fix's state, and each fix's self-test (red control, then green).

    python tools/doctor.py            # exit 1 if any self-test step fails

With COMFYUI_PATH set, the fixes are detected against that ComfyUI checkout (its requirements must be
installed in the running Python).
"""

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_pack(name: str = "minimax_hotfix"):
    """Import the pack's subpackages under ``name`` without running its ComfyUI entry point."""
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(ROOT)]
        sys.modules[name] = package
    return sys.modules[name]


def main() -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    load_pack()
    from minimax_hotfix.patches._comfy import use_comfyui_checkout
    from minimax_hotfix.patches._report import run_doctor

    use_comfyui_checkout()
    return run_doctor()


if __name__ == "__main__":
    sys.exit(main())
