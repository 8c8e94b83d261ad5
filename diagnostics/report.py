"""What the doctor prints: the environment, each fix's state and retirement (the Status node's table), and the
self-tests, as text or as the JSON document described in docs/doctor.md (schema: docs/doctor.schema.json)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from ..contract import Check, Fix, package_version
from ..registry import all_fixes, attachment, status
from ..registry.prompt_fixing import PROMPT_FIXING
from ..registry.ray_actors import LAST_RUN
from ..registry.status_table import machine_rows, retirement_rows, status_rows, status_table, text_table
from . import self_test
from .progress import progress

PACK_ROOT = Path(__file__).resolve().parents[1]
SCHEMA_VERSION = 2


def pack_version() -> str:
    """The ``version`` of pyproject.toml's [project] table (read as text: Python 3.10 has no tomllib)."""
    try:
        text = (PACK_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    found = re.search(r'(?m)^version\s*=\s*"([^"]+)"', text)
    return found.group(1) if found else "unknown"


def pack_commit() -> str | None:
    """The checked-out commit when the pack is a git checkout (a git clone install), else None."""
    if not (PACK_ROOT / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(PACK_ROOT), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def pack_release() -> str:
    commit = pack_commit()
    return f"{pack_version()} ({f'git {commit}' if commit else 'not a git checkout'})"


def comfyui_version() -> str:
    module = sys.modules.get("comfyui_version")
    if module is None:
        root = os.environ.get("COMFYUI_PATH")
        if not root:
            return "not loaded (set COMFYUI_PATH to check a ComfyUI checkout)"
        try:
            text = open(os.path.join(root, "comfyui_version.py"), encoding="utf-8").read()
        except OSError as exc:
            return f"unreadable at {root}: {exc}"
        return text.split("=", 1)[-1].strip().strip("\"'") + f" ({root})"
    return getattr(module, "__version__", "unknown")


def environment() -> list[tuple[str, str, str | list[str] | None]]:
    """(JSON key, label, value) per row: what a bug report needs."""
    from .devices import devices  # imports torch, which ``--version`` must not need

    return [
        ("pack_version", "MiniMax Hotfix", pack_version()),
        ("pack_commit", "commit", pack_commit()),
        ("os", "OS", platform.platform()),
        ("python", "python", f"{platform.python_version()} ({sys.executable})"),
        ("comfyui", "ComfyUI", comfyui_version()),
        ("torch", "torch", package_version("torch")),
        ("comfy_kitchen", "comfy-kitchen", package_version("comfy-kitchen")),
        ("transformers", "transformers", package_version("transformers")),
        ("gguf", "gguf", package_version("gguf")),
        ("ray", "ray (raylight's multi-GPU runtime)", package_version("ray")),
        ("devices", "devices", devices()),
        ("server_side_fixing", "server-side fixing", PROMPT_FIXING.describe()),
        ("raylight", "raylight (multi-GPU)", LAST_RUN.describe()),
    ]


@dataclass
class SelfTest:
    """One fix's self-test: its steps, or why it raised (``error``) or did not run here (``not_run``)."""

    fix: str
    steps: list[Check] = field(default_factory=list)
    error: str | None = None
    not_run: str | None = None

    @property
    def failed(self) -> int:
        return sum(not step.passed for step in self.steps) + (self.error is not None)


def run_self_test(fix: Fix) -> SelfTest:
    try:
        steps = list(self_test(fix))
    except Exception as exc:
        return SelfTest(fix.id, error=f"{type(exc).__name__}: {exc}")
    return SelfTest(fix.id, steps, not_run=None if steps else status(fix).reason)


def step_kind(check: Check) -> str:
    """"red" (the bug reproduces with the fix off), "green" (fixed) or "other", from the step's name."""
    kind = check.name.split(":", 1)[0].strip()
    return kind if kind in ("red", "green") else "other"


def doctor_report(fixes: list[Fix] | None = None, show_progress: bool = False) -> dict:
    """The doctor's JSON document (docs/doctor.md): environment, states and self-tests of ``fixes`` (default all);
    with ``show_progress``, each self-test (done/total, elapsed) on stderr as it runs."""
    tested = list(all_fixes().values() if fixes is None else fixes)
    if show_progress:
        tested = progress(tested, "self-tests", lambda fix: fix.id)
    tests = [run_self_test(fix) for fix in tested]
    failed = sum(test.failed for test in tests)
    retirement = {fix_id: {"fixed_by": fixed_by, "delete_when": delete_when}
                  for fix_id, fixed_by, delete_when in retirement_rows(fixes)}
    attached = {fix.id: attachment(fix)._asdict() for fix in (all_fixes().values() if fixes is None else fixes)}
    return {
        "schema_version": SCHEMA_VERSION,
        "environment": {key: value for key, _, value in environment()},
        "fixes": [{"id": fix_id, "state": state, "reason": reason, "attached": attached.get(fix_id),
                   **retirement.get(fix_id, {"fixed_by": None, "delete_when": None})}
                  for fix_id, state, reason in status_rows(fixes)],
        "machine": [{"fix": fix_id, "line": line} for fix_id, line in machine_rows(fixes)],
        "self_tests": [
            {"fix": test.fix, "error": test.error, "not_run": test.not_run,
             "steps": [{"name": step.name, "kind": step_kind(step), "passed": step.passed, "detail": step.detail}
                       for step in test.steps]}
            for test in tests
        ],
        "failed_steps": failed,
        "exit_code": 1 if failed else 0,
    }


def run_doctor(out=print, fixes: list[Fix] | None = None, width: int | None = None) -> int:
    """Print the environment, the fix states and the self-tests of ``fixes`` (default all), each line fitted to
    ``width`` when given; return the process exit code."""
    wrap = (lambda text: textwrap.fill(text, width, subsequent_indent=" " * 8, break_on_hyphens=False)) if width \
        else (lambda text: text)
    out(text_table([(label, ", ".join(value) if isinstance(value, list) else value or "not a git checkout")
                for _, label, value in environment()], width=width))
    out("")
    out(status_table(width, fixes))
    failed = 0
    for fix in all_fixes().values() if fixes is None else fixes:
        test = run_self_test(fix)
        failed += test.failed
        out(f"\nself-test {fix.id}:")
        if test.error:
            out(wrap(f"  FAIL  self-test raised {test.error}"))
        for step in test.steps:
            out(wrap(f"  {'ok  ' if step.passed else 'FAIL'}  {step.name}" + (f": {step.detail}" if step.detail else "")))
        if test.not_run:
            out(wrap(f"  (not run here: {test.not_run})"))
    out(f"\n{'all self-tests passed' if not failed else f'{failed} self-test step(s) failed'}")
    return 1 if failed else 0
