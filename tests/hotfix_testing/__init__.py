"""The tests' shared helpers, one package: ``from hotfix_testing import comfyui_server`` (pytest's ``pythonpath``
setting in pyproject.toml puts tests/ on the path, tools/ for the pack as ``minimax_hotfix``; docs/testing.md, "How
the tests import the pack"). Never imported by the pack; a benchmark that uses one puts the same folders on its path.
"""

import os
from pathlib import Path

# pyproject.toml's pythonpath (tests/test_import_paths.py keeps them equal): the pack and these helpers
IMPORT_PATH = tuple(str(Path(__file__).resolve().parents[2] / folder) for folder in ("tools", "tests"))


def child_pythonpath(*first: str | None) -> str:
    """``PYTHONPATH`` for a child Python that imports the pack or these helpers as the tests do: ``first`` (overlays,
    an inherited PYTHONPATH; None skipped), then the tests' own import path."""
    return os.pathsep.join(filter(None, (*first, *IMPORT_PATH)))
