"""The command line of a pytest run nested in a test, where the test is about a fresh interpreter itself (the
simulated accelerator's own checks, pytest stopping on an unusable COMFYUI_PATH); the cores and the other
transformers are tiers of their own (tests/hotfix_testing/tiers.py). Nested runs keep the order as written unless
``MINIMAX_HOTFIX_SHUFFLE_NESTED=1``: then they shuffle with the outer run's seed, so one seed reproduces both."""

import os
import sys

SHUFFLE_ENV = "MINIMAX_HOTFIX_SHUFFLE_NESTED"
_outer = []  # the outer run's pytest config, set by tests/conftest.py


def follow(config) -> None:
    _outer[:] = [config]


def pytest_command(*args: str) -> list[str]:
    """``python -m pytest -q -p no:cacheprovider``, the order (see the module docstring), then ``args``."""
    seed = _outer[0].getoption("randomly_seed", None) if _outer else None
    shuffle = seed is not None and os.environ.get(SHUFFLE_ENV) == "1"
    shuffling = [f"--randomly-seed={seed}"] if shuffle else ["-p", "no:randomly"]
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shuffling, *args]
