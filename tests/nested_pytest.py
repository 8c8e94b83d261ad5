"""The command line of a pytest run nested in a test (a fresh interpreter, another transformers, a simulated core):
it shuffles as the outer run does, with the outer run's seed, so one seed reproduces both (docs/testing.md)."""

import sys

_outer = []  # the outer run's pytest config, set by tests/conftest.py


def follow(config) -> None:
    _outer[:] = [config]


def pytest_command(*args: str) -> list[str]:
    """``python -m pytest -q -p no:cacheprovider``, the outer run's shuffling, then ``args``."""
    seed = _outer[0].getoption("randomly_seed", None) if _outer else None
    shuffling = ["-p", "no:randomly"] if seed is None else [f"--randomly-seed={seed}"]
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shuffling, *args]
