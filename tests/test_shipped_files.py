"""What ships runs from what ships: the Registry package leaves out what ``.comfyignore`` names (the tests, the
benchmarks that run on the tests' servers and synthetic models, CI, the development commands that need the tests),
so no shipped file that runs (Python, shell, JavaScript) may reach into what is left out."""

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.stdlib


def left_out() -> set[str]:
    return {line.strip().strip("/") for line in (ROOT / ".comfyignore").read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")}


RUNS = (".py", ".sh", ".js", ".bat", ".ps1", ".cmd")  # what a user of the package can run; docs may name anything


def shipped_files(suffixes=RUNS) -> list[Path]:
    skipped = left_out()
    found = []
    for folder, folders, files in os.walk(ROOT):  # pruned: the checkout's virtual environments are gigabytes
        folders[:] = [name for name in folders if not name.startswith(".") and name not in skipped
                      and name != "__pycache__"]
        for name in files:
            path = Path(folder, name)
            if path.suffix in suffixes and path.relative_to(ROOT).as_posix() not in skipped:
                found.append(path)
    return found


def shipped_python_files() -> list[Path]:
    return shipped_files((".py",))


def reaching_left_out(path: Path, skipped: set[str]) -> list[int]:
    """The lines of a non-Python file that name a left-out folder or file as a path."""
    names = "|".join(re.escape(name) for name in sorted(skipped))
    pattern = re.compile(rf"(^|[\s\"'=(:/$]){names}(/|\b)")
    return [number for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if pattern.search(line) and not line.lstrip().startswith(("#", "//"))]


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


def test_no_shipped_script_reaches_what_is_left_out():
    """Shell and JavaScript too. Red before the development commands were left out: tools/test.sh and tools/venv.sh
    read tests/requirements*.txt and run tests/."""
    skipped = left_out()
    reaching = sorted(f"{path.relative_to(ROOT)}:{line}" for path in shipped_files()
                      if path.suffix != ".py" for line in reaching_left_out(path, skipped))
    assert shipped_files() and not reaching, reaching


def test_the_script_check_finds_a_reach():
    # red control: the development commands as they are, read as if shipped
    skipped = left_out() - {"tools/test.sh", "tools/venv.sh"}
    assert reaching_left_out(ROOT / "tools" / "venv.sh", skipped)
    assert reaching_left_out(ROOT / "tools" / "test.sh", skipped)
