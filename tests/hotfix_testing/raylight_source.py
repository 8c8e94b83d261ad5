"""raylight's source (komikndr/raylight 1.9.0, the first release with MiniMax H3) for the tests: ``../shared/raylight``
beside the project checkout, read-only, never copied into the repo; tests that need it skip where it is absent.

``node_return_types`` reads its nodes' outputs from the code (no import: raylight imports xfuser and CUDA-only
parts at module level); ``copy_package`` puts its ``raylight`` package into a temporary folder for a test to
import."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAYLIGHT = ROOT.parent / "shared" / "raylight" / "9a7c33d"
NODE_FILES = ("src/raylight/nodes.py", "src/raylight/expansion/comfyui_gguf/nodes.py")


def available() -> bool:
    return (RAYLIGHT / "src" / "raylight").is_dir()


def node_return_types() -> dict[str, list[str]]:
    """{node class: its RETURN_TYPES} for the classes of raylight's node files that declare them as literals."""
    found = {}
    for name in NODE_FILES:
        for node in ast.parse((RAYLIGHT / name).read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if isinstance(statement, ast.Assign) and any(
                            getattr(target, "id", None) == "RETURN_TYPES" for target in statement.targets):
                        try:
                            found[node.name] = list(ast.literal_eval(statement.value))
                        except ValueError:  # built from names (``IO.LATENT``): no loader of the pack's concern
                            pass
    return found


def copy_package(folder: Path) -> Path:
    """raylight's ``raylight`` package copied under ``folder`` (put ``folder`` on the path to import it)."""
    shutil.copytree(RAYLIGHT / "src" / "raylight", folder / "raylight")
    return folder
