"""Fixtures for int8 tests on a device without ``torch._int_mm`` (Apple MPS before torch 2.15): ``int_mm_missing``
makes the op raise MPS's own error and forgets the pack's int8 probes around the test; ``unload`` frees ComfyUI's
models and the pack's ``linear_input_act`` wrapper after it. A plugin that tests/conftest.py loads."""

import pytest
import torch

from hotfix_testing.comfy_memory import unload_all_models
from minimax_hotfix.diagnostics.self_tests.int8_full_precision_mm import (
    MPS_INT_MM_ERROR,
    forget_int8_probes,
    unwrap_linear_input_act,
)


@pytest.fixture
def int_mm_missing(monkeypatch):
    def missing(*args, **kwargs):
        raise NotImplementedError(MPS_INT_MM_ERROR)

    monkeypatch.setattr(torch, "_int_mm", missing)
    forget_int8_probes()
    yield
    forget_int8_probes()


@pytest.fixture
def unload():

    yield
    unload_all_models()
    unwrap_linear_input_act()
