"""The pack imports outside ComfyUI without touching ComfyUI and exports no nodes there."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_entry_point_imports_without_comfyui():
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('comfy') is None, 'this check needs a Python without ComfyUI on its path'\n"
        # by path under a synthetic name, as ComfyUI loads a custom node: the subject of this test
        f"spec = importlib.util.spec_from_file_location('pack_x_minimax', {str(ROOT / '__init__.py')!r},"
        f" submodule_search_locations=[{str(ROOT)!r}])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m)\n"
        "assert m.NODE_CLASS_MAPPINGS == {}, m.NODE_CLASS_MAPPINGS\n"
        "assert not any(k == 'comfy' or k.startswith('comfy.') for k in sys.modules), 'imported ComfyUI'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
