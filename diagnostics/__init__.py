"""What the doctor (tools/doctor.py) and the tests use to prove the fixes, never imported at ComfyUI start-up: each
fix's self-test (``self_tests/<fix id>.py``, red control then green), the tiny models they run, a second device
(``devices.py``), comfy-kitchen routing replayed on a CPU (``kitchen.py``), CUDA-graph capture rules emulated on a
CPU (``emulated_capture.py``), the doctor's report (``report.py``) and the placement audit of model files
(``placement_audit.py``)."""

from __future__ import annotations

import importlib
from typing import Iterable

from ..contract import Check, Fix


def self_test(fix: Fix) -> Iterable[Check]:
    """The steps of ``fix``'s self-test (``self_tests/<fix id>.py``'s ``self_test()``); none where it has none."""
    name = f"{__name__}.self_tests.{fix.id}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return ()
    return module.self_test()
