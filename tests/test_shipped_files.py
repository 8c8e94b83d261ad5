"""What ships runs from what ships: the Registry package leaves out what ``.comfyignore`` names (the tests, the
benchmarks that run on the tests' servers and synthetic models, CI), so no shipped Python file may reach into a folder
left out."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.stdlib


def left_out() -> set[str]:
    return {line.strip().strip("/") for line in (ROOT / ".comfyignore").read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")}


def shipped_python_files() -> list[Path]:
    skipped = left_out()
    return [path for path in ROOT.rglob("*.py") if not any(
        part.startswith(".") or part in skipped or part == "__pycache__" for part in path.relative_to(ROOT).parts)]


def test_no_shipped_file_reaches_a_folder_left_out():
    """A path built from a left-out folder's name (``ROOT / "tests"``, ``sys.path`` entries) in a shipped file fails
    in the package. Red before ``benchmarks/`` was left out: ``benchmarks/gpu_check.py`` and
    ``benchmarks/vae_qk_norm_scale.py`` put ``tests/`` on ``sys.path``."""
    skipped = left_out()
    reaching = sorted(f"{path.relative_to(ROOT)}:{node.lineno}" for path in shipped_python_files()
                      for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                      if isinstance(node, ast.Constant) and isinstance(node.value, str)
                      and node.value.strip("/") in skipped)
    assert shipped_python_files() and not reaching, reaching
