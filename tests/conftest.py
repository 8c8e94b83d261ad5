"""Loads the pack as the package ``minimax_hotfix`` (without its ComfyUI entry point) and offers the
``comfyui`` fixture for tests that need a real ComfyUI checkout (COMFYUI_PATH; skipped without it), the
``registry`` fixture and ``fresh_detection``."""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tools"), str(HERE)]  # tools/doctor.py's load_pack; shared test helpers
from doctor import load_pack  # noqa: E402

load_pack()


@pytest.fixture(scope="session")
def comfyui():
    """The path of a real ComfyUI, importable and in CPU mode when no GPU is present."""
    if not os.environ.get("COMFYUI_PATH"):
        pytest.skip("needs ComfyUI: runs in the 'with ComfyUI' run of bash tools/test.sh (or set COMFYUI_PATH)")
    from minimax_hotfix.diagnostics.comfyui_checkout import ComfyUIUnavailable, use_comfyui_checkout

    try:
        return use_comfyui_checkout()
    except ComfyUIUnavailable as exc:
        pytest.exit(str(exc), returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture
def registry(monkeypatch):
    """``registry(*fixes)``: the pack's registry holding only these fixes, with fresh detection."""
    from minimax_hotfix import registry as pack_registry

    def use(*fixes):
        monkeypatch.setattr(pack_registry, "_fixes", {fix.id: fix for fix in fixes})
        pack_registry.forget_detection()
        return fixes

    yield use
    pack_registry.forget_detection()


@pytest.fixture
def fresh_detection(monkeypatch):
    """Every fix detected afresh, with the off switch unset; forgotten again after the test."""
    from minimax_hotfix import registry as pack_registry

    monkeypatch.delenv(pack_registry.DISABLE_ENV, raising=False)
    pack_registry.forget_detection()
    yield
    pack_registry.forget_detection()


def pytest_terminal_summary(terminalreporter):
    """The seed scenario table, if this run made one; the simulated cores this run built, with their overlays and
    stand-ins."""
    import scenario_table
    import simulated_cores

    if scenario_table.ROWS:
        terminalreporter.section("seed scenarios on the simulated accelerator")
        for line in scenario_table.lines():
            terminalreporter.write_line(line)
    if simulated_cores.BUILT:
        terminalreporter.section("simulated cores")
        for name in simulated_cores.BUILT:
            terminalreporter.write_line(simulated_cores.describe(name))
