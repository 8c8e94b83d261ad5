"""What the status node and the doctor print: the environment, each fix's state, and the self-tests, as text or
as the JSON document described in docs/doctor.md (schema: docs/doctor.schema.json)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from . import all_fixes, broken_modules, status
from ._fix import Check, Fix, State

PACK_ROOT = Path(__file__).resolve().parents[1]
SCHEMA_VERSION = 1


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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


def devices() -> list[str]:
    import torch

    if torch.cuda.is_available():
        found = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            found.append(f"cuda:{index} {props.name} ({props.total_memory / 2**30:.0f} GiB)")
        return found
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return ["mps"]
    return ["cpu (a second device is simulated with FakeTensor 'cuda' / meta)"]


def environment() -> list[tuple[str, str, str | list[str] | None]]:
    """(JSON key, label, value) per row: what a bug report needs."""
    return [
        ("pack_version", "MiniMax Hotfix", pack_version()),
        ("pack_commit", "commit", pack_commit()),
        ("os", "OS", platform.platform()),
        ("python", "python", f"{platform.python_version()} ({sys.executable})"),
        ("comfyui", "ComfyUI", comfyui_version()),
        ("torch", "torch", _version("torch")),
        ("comfy_kitchen", "comfy-kitchen", _version("comfy-kitchen")),
        ("transformers", "transformers", _version("transformers")),
        ("gguf", "gguf", _version("gguf")),
        ("devices", "devices", devices()),
    ]


def status_rows(fixes: list[Fix] | None = None) -> list[tuple[str, str, str]]:
    """(id, state, reason) per fix; without ``fixes``, every fix and every fix module that failed to import."""
    rows = []
    for fix in all_fixes().values() if fixes is None else fixes:
        found = status(fix)  # once: a provisional status may change between two calls
        rows.append((fix.id, found.state.value, found.reason))
    if fixes is None:
        rows += [(name, State.FAILED.value, f"module failed to import: {err}") for name, err in broken_modules().items()]
    return rows


def _table(rows, headers=None, width: int | None = None) -> str:
    """Columns padded to their widest cell; with ``width``, the last column wraps to fit it."""
    rows = [tuple(map(str, row)) for row in rows]
    shown = [*([tuple(headers)] if headers else []), *rows]
    widths = [max(len(row[i]) for row in shown) for i in range(len(rows[0]))]
    lead = sum(widths[:-1]) + 2 * (len(widths) - 1)
    last = max(width - lead, 20) if width else None
    if last:
        widths[-1] = min(widths[-1], last)

    def lines(row):
        first = "".join(cell.ljust(w) + "  " for cell, w in zip(row[:-1], widths))
        parts = (textwrap.wrap(row[-1], last, break_on_hyphens=False) if last else [row[-1]]) or [""]
        return [((first if i == 0 else " " * len(first)) + part).rstrip() for i, part in enumerate(parts)]

    head = [*lines(headers), "  ".join("-" * w for w in widths)] if headers else []
    return "\n".join([*head, *(line for row in rows for line in lines(row))])


def status_table(width: int | None = None, fixes: list[Fix] | None = None) -> str:
    rows = status_rows(fixes)
    if not rows:
        return "No fix is registered yet."
    return _table(rows, ("fix", "state", "reason"), width)


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
        steps = list(fix.self_test())
    except Exception as exc:
        return SelfTest(fix.id, error=f"{type(exc).__name__}: {exc}")
    return SelfTest(fix.id, steps, not_run=None if steps else status(fix).reason)


def step_kind(check: Check) -> str:
    """"red" (the bug reproduces with the fix off), "green" (fixed) or "other", from the step's name."""
    kind = check.name.split(":", 1)[0].strip()
    return kind if kind in ("red", "green") else "other"


def doctor_report(fixes: list[Fix] | None = None) -> dict:
    """The doctor's JSON document (docs/doctor.md): environment, states and self-tests of ``fixes`` (default all)."""
    tests = [run_self_test(fix) for fix in (all_fixes().values() if fixes is None else fixes)]
    failed = sum(test.failed for test in tests)
    return {
        "schema_version": SCHEMA_VERSION,
        "environment": {key: value for key, _, value in environment()},
        "fixes": [{"id": fix_id, "state": state, "reason": reason} for fix_id, state, reason in status_rows(fixes)],
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
    out(_table([(label, ", ".join(value) if isinstance(value, list) else value or "not a git checkout")
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
