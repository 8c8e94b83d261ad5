"""A fix lives in its own files: the lists kept elsewhere are checked against the registry here, each test naming
the missing or stale entry. The upstream facts of a fix have one source, its ``retirement.fixed_by``; its banner (the
fix module's docstring) and its doc name the same upstream changes.

Adding a fix is its ``patches/<id>.py`` (+ ``kernels/``), ``diagnostics/self_tests/<id>.py``, its test, its doc
``docs/<id>.md`` and one row of the README's table; a process-wide one also goes into ``patches.PROCESS_WIDE``
(tests/test_registry.py), and the per-core status matrix of tests/test_simulated_cores.py gets its expected state.
"""

from __future__ import annotations

import ast
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


FIX_FILE_MOST_LINES = 220  # every fix file has kept under it since the redesign: what is not the fix's own goes out
MUTABLE_STATE = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
STATE_FACTORIES = {"dict", "list", "set", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "RLock", "Lock"}


def module_level_state(source: str) -> list[str]:
    """The module globals a fix file changes at run time (``global``) or creates as containers and locks: state every
    call of the process shares, which belongs on the fix's instance under its lock (docs/architecture.md)."""
    tree = ast.parse(source)
    found = [f"global {', '.join(node.names)} (line {node.lineno})" for node in ast.walk(tree)
             if isinstance(node, ast.Global)]
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if value is None or not all(isinstance(t, ast.Name) and t.id.startswith("_") for t in targets):
            continue  # public upper-case names are constant tables, read only
        factory = value.func if isinstance(value, ast.Call) else None
        name = getattr(factory, "attr", getattr(factory, "id", None))
        if isinstance(value, MUTABLE_STATE) or name in STATE_FACTORIES:
            found.append(f"{targets[0].id} (line {node.lineno})")
    return found


@pytest.mark.parametrize("fix_id", FIX_IDS)
def test_a_fix_file_stays_small_and_keeps_its_state_on_its_instance(fix_id):
    source = (ROOT / "patches" / f"{fix_id}.py").read_text(encoding="utf-8")
    assert len(source.splitlines()) <= FIX_FILE_MOST_LINES
    assert module_level_state(source) == []


def test_module_level_state_is_found():
    # Red control: the shapes the fixes had before their state moved onto their instances.
    assert module_level_state("import weakref\n_attached = weakref.WeakKeyDictionary()\n") == ["_attached (line 2)"]
    assert module_level_state("_verdict = None\ndef f():\n    global _verdict\n    _verdict = 1\n") == [
        "global _verdict (line 3)"]
    assert module_level_state("_lock: object = threading.RLock()\nKNOWN = {'a': 1}\n") == ["_lock (line 1)"]
