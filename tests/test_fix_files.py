"""A fix lives in its own files: the lists kept elsewhere are checked against the registry here, each test naming
the missing or stale entry. The upstream facts of a fix have one source, its ``retirement.fixed_by``; its banner (the
fix module's docstring) and its doc name the same upstream changes.

Adding a fix is its ``patches/<id>.py`` (+ ``kernels/``), ``diagnostics/self_tests/<id>.py``, its test, its doc
``docs/<id>.md`` and one row of the README's table; a process-wide one also goes into ``patches.PROCESS_WIDE``
(tests/test_registry.py), and the per-core status matrix of tests/test_simulated_cores.py gets its expected state.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from minimax_hotfix import registry as pack_registry

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_REFERENCE = re.compile(r"#\d+")  # an issue or pull request number, as every banner and doc writes it
README_FIX_ROW = re.compile(r"^\| `(\w+)` \|", re.MULTILINE)
FIX_IDS = pack_registry.fix_module_names()


def fix_doc(fix_id: str) -> Path:
    """``docs/<id>.md``, or, for a fix documented beside another (ck_rope_device in vae_qk_norm_scale's), the one doc
    of another fix that names it."""
    own = ROOT / "docs" / f"{fix_id}.md"
    if own.exists():
        return own
    (shared,) = [ROOT / "docs" / f"{other}.md" for other in FIX_IDS
                 if (ROOT / "docs" / f"{other}.md").exists() and f"`{fix_id}`" in (ROOT / "docs" / f"{other}.md").read_text()]
    return shared


@pytest.mark.parametrize("fix_id", FIX_IDS)
def test_each_fix_has_its_self_test_and_doc(fix_id):
    assert (ROOT / "diagnostics" / "self_tests" / f"{fix_id}.py").exists(), f"no self-test for {fix_id}"
    assert fix_doc(fix_id).exists(), f"no doc for {fix_id}"


def test_the_readme_table_has_one_row_per_fix():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("## What it fixes", 1)[1].split("\n## ", 1)[0]
    rows = README_FIX_ROW.findall(table)
    assert sorted(set(FIX_IDS) - set(rows)) == [], "fixes without a README row"
    assert sorted(set(rows) - set(FIX_IDS)) == [], "README rows naming no fix"
    assert len(rows) == len(set(rows)), "a fix with two README rows"


@pytest.mark.parametrize("fix_id", FIX_IDS)
def test_banner_and_doc_name_the_upstream_changes_of_fixed_by(fix_id):
    fix = pack_registry.all_fixes()[fix_id]
    named = set(UPSTREAM_REFERENCE.findall(fix.retirement.fixed_by))
    banner = sys.modules[type(fix).__module__].__doc__
    assert sorted(named - set(UPSTREAM_REFERENCE.findall(banner))) == [], f"{fix_id}'s banner lacks these"
    assert sorted(named - set(UPSTREAM_REFERENCE.findall(fix_doc(fix_id).read_text()))) == [], \
        f"{fix_doc(fix_id).name} lacks these upstream changes of {fix_id}"


@pytest.mark.parametrize("fix_id", FIX_IDS)
def test_a_fix_reaches_comfyui_through_plain_imports(fix_id):
    """A fix names the ComfyUI modules it reaches in import statements (inside the functions that need them), not as
    strings handed to an importer: breakage tools that read imports (comfy-import-guard) then see what it depends
    on. Red before: ``comfy_module("comfy.ops")`` everywhere, 0 references found in patches/."""
    import ast

    tree = ast.parse((ROOT / "patches" / f"{fix_id}.py").read_text(encoding="utf-8"))
    by_name = [node.args[0].value for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "id", getattr(node.func, "attr", None)) in {"comfy_module", "import_module"}
               and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value.startswith("comfy")]
    assert not by_name, f"{fix_id} imports {by_name} by name"
