"""How the tests, the tools and the benchmarks import (docs/testing.md, "How the tests import the pack"): the pack as
``minimax_hotfix`` through tools/minimax_hotfix, the tests' helpers as ``hotfix_testing``, both on pytest's
``pythonpath``; no other edit of ``sys.path`` and no module loaded from its file, but those listed here with their
reason. A new one fails here: import it plainly, or add it to ``ALLOWED`` with its reason."""

import ast
import re
import sys
from pathlib import Path

import pytest
import tomllib

import hotfix_testing
import minimax_hotfix

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "tools", "benchmarks", "diagnostics")  # issue 38's grep: sys.path|spec_from_file_location
# an edit of sys.path (insert, append, extend, an assignment to it or a slice) or a load by path, in code or in the
# code a test hands a child Python as text
PATH_EDIT = re.compile(r"\bsys\.path\s*(?:\.\s*(?:insert|append|extend)\s*\(|(?:\[[^\]]*\])?\s*\+?=(?!=))"
                       r"|\bspec_from_file_location\s*\(")
RUN_BY_PATH = ("run by path: a script's own folder is all Python puts on its path, and isolated Pythons (python -I, "
               "ComfyUI portable's python_embeded, whose ._pth file turns isolated mode on) not even that")
ALLOWED = {
    "tools/doctor.py": (1, RUN_BY_PATH),
    "tools/swap_loaders.py": (1, RUN_BY_PATH),
    **{f"benchmarks/{name}.py": (1, RUN_BY_PATH) for name in (
        "gpu_check", "h3_fp16_overflow", "int8_full_precision_mm", "music3_graph_capture", "prompt_fixing", "qwen3vl_pos_embed",
        "qwen3vl_rotary_table", "vae_qk_norm_scale")},
    "diagnostics/comfyui_checkout.py": (1, "use_comfyui_checkout(): ComfyUI is no package, its checkout goes on the "
                                           "path (the doctor, the audit, the benchmarks and the tests' one way)"),
    "tests/hotfix_testing/prompt_validation.py": (1, "a child run with ComfyUI's Python by path: ComfyUI imported "
                                                     "from its checkout as its main.py is"),
    "tests/comfyui_probe/__init__.py": (1, "a custom node inside the test's ComfyUI server, whose path holds "
                                           "ComfyUI, not the tests: the synthetic models' helper from its file"),
    "tests/comfyui_gguf_stand_in/__init__.py": (1, "a custom node inside the test's ComfyUI server, whose path holds "
                                                   "ComfyUI, not the tests: the GGUF helpers from their folder, as "
                                                   "a package of their own"),
    "tests/test_ray_actors.py": (2, "raylight, which is no package on PyPI, goes on the path from its copy; each Ray "
                                    "worker takes the pack's folder, which Ray puts there, off its path"),
    "tests/test_pack_import.py": (1, "the subject: the entry point loaded by path under a synthetic name, as "
                                     "ComfyUI loads a custom node"),
    "tests/hotfix_testing/mutant_runs.py": (1, "a mutant's edited ComfyUI module executed from its file under the "
                                               "module's own name"),
}


def path_edits(text: str) -> int:
    return len(PATH_EDIT.findall(text))


def found() -> dict:
    files = (path for folder in SCANNED for path in (ROOT / folder).rglob("*.py")
             if path != Path(__file__).resolve())  # its red controls' snippets
    counts = {path.relative_to(ROOT).as_posix(): path_edits(path.read_text(encoding="utf-8")) for path in files}
    return {path: count for path, count in counts.items() if count}


def test_path_edits_are_only_the_listed_ones():
    assert found() == {path: count for path, (count, _) in ALLOWED.items()}


@pytest.mark.parametrize("code", [
    "sys.path.insert(0, folder)", "sys.path.append(folder)", "sys.path.extend([folder])", "sys.path[:0] = [folder]",
    "sys.path += [folder]", "sys.path = [folder]", 'code = "sys.path.insert(0, {tools!r})"',
    "spec = importlib.util.spec_from_file_location(name, path)",
])
def test_red_control_each_kind_of_edit_counts(code):
    assert path_edits(f"import importlib.util, sys\n{code}\n") == 1


def test_red_control_mentions_and_reads_do_not_count():
    assert path_edits('"""puts ``tests/`` on ``sys.path``"""\nif path not in sys.path:\n    x = sys.path[0]\n'
                      "assert sys.path == before\n") == 0


def test_pytest_puts_the_helpers_import_path_on_the_path():
    """pyproject.toml's ``pythonpath`` and ``hotfix_testing.IMPORT_PATH`` (a child's PYTHONPATH) are the same."""
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert [str(ROOT / folder) for folder in ini["pythonpath"]] == list(hotfix_testing.IMPORT_PATH)
    assert all(folder in sys.path for folder in hotfix_testing.IMPORT_PATH)


def test_minimax_hotfix_is_the_pack_without_its_comfyui_entry_point():
    """``import minimax_hotfix`` in the tests is tools/minimax_hotfix: the pack's modules, never its entry point (which,
    with ComfyUI importable, would install process-wide fixes as a side effect of a test's import)."""
    assert Path(minimax_hotfix.__file__) == ROOT / "tools" / "minimax_hotfix" / "__init__.py"
    assert minimax_hotfix.__path__ == [str(ROOT)]
    assert not hasattr(minimax_hotfix, "NODE_CLASS_MAPPINGS")
    from minimax_hotfix import registry

    assert Path(registry.__file__) == ROOT / "registry" / "__init__.py"
    tree = ast.parse((ROOT / "tools" / "minimax_hotfix" / "__init__.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in node.names} | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported - {"Path"} <= set(sys.stdlib_module_names)
