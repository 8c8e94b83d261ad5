"""Rerun a test file in a subprocess against a simulated ComfyUI core (tests/simulated_cores.py), in the Python
running the tests. The subprocess sees ``SIMULATED_CORE_ENV`` set to the core's name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from simulated_cores import ROOT, build_core, describe

SIMULATED_CORE_ENV = "MINIMAX_HOTFIX_SIMULATED_CORE"


def running_on_simulated_core() -> str | None:
    return os.environ.get(SIMULATED_CORE_ENV)


def pytest_on_core(name: str, test_file: str, workdir: Path, *pytest_args: str, timeout: int = 600):
    """Build core ``name`` under ``workdir`` and run ``pytest test_file *pytest_args`` on it; returns the completed
    process (stdout starts with the core's description)."""
    core = build_core(name, workdir / "ComfyUI")
    env = {**os.environ, "COMFYUI_PATH": str(core), SIMULATED_CORE_ENV: name}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, *pytest_args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    done.stdout = describe(name) + "\n" + done.stdout
    return done
