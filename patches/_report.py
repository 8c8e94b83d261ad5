"""What the status node and the doctor print: the environment, each fix's state, and the self-tests."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

from . import all_fixes, broken_modules, status


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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


def compute_device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu (a second device is simulated with FakeTensor 'cuda' / meta)"


def environment() -> list[tuple[str, str]]:
    return [
        ("python", platform.python_version()),
        ("ComfyUI", comfyui_version()),
        ("torch", _version("torch")),
        ("comfy-kitchen", _version("comfy-kitchen")),
        ("transformers", _version("transformers")),
        ("gguf", _version("gguf")),
        ("compute device", compute_device()),
    ]


def status_rows() -> list[tuple[str, str, str]]:
    rows = []
    for fix in all_fixes().values():
        found = status(fix)  # once: a provisional status may change between two calls
        rows.append((fix.id, found.state.value, found.reason))
    rows += [(name, "disabled", f"module failed to import: {err}") for name, err in broken_modules().items()]
    return rows


def _table(rows, headers=None) -> str:
    widths = [max(len(str(row[i])) for row in [*([headers] if headers else []), *rows]) for i in range(len(rows[0]))]
    line = lambda row: "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip()  # noqa: E731
    head = [line(headers), line(["-" * w for w in widths])] if headers else []
    return "\n".join([*head, *map(line, rows)])


def status_table() -> str:
    rows = status_rows()
    if not rows:
        return "No fix is registered yet."
    return _table(rows, ("fix", "state", "reason"))


def run_doctor(out=print) -> int:
    """Print the environment, the fix states and every self-test; return the process exit code."""
    out(_table(environment()))
    out("")
    out(status_table())
    failed = 0
    for fix in all_fixes().values():
        out(f"\nself-test {fix.id}:")
        try:
            checks = list(fix.self_test())
        except Exception as exc:
            out(f"  FAIL  self-test raised {type(exc).__name__}: {exc}")
            failed += 1
            continue
        for check in checks:
            out(f"  {'ok  ' if check.passed else 'FAIL'}  {check.name}" + (f": {check.detail}" if check.detail else ""))
            failed += not check.passed
        if not checks:
            out(f"  (not run here: {status(fix).reason})")
    out(f"\n{'all self-tests passed' if not failed else f'{failed} self-test step(s) failed'}")
    return 1 if failed else 0
