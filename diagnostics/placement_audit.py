"""Placement audit: where ComfyUI's loaders leave each MiniMax model's tensors, and what that costs per call.

For each model the running ComfyUI can build, the real class is built at its real configuration with FakeTensor
weights (shapes only: nothing full-size is allocated), loaded through ComfyUI's real ``ModelPatcher.load`` as the
legacy partial loader does at several VRAM budgets and through ``ModelPatcherDynamic`` (``placement_audit_dynamic``),
and run once with small inputs, compute on FakeTensor ``cuda:0``.
A dispatch mode watches every op of that call and records, per model and budget:

* ``cross-device``: an op given tensors on two devices (a crash on a GPU); the audit moves the stray operand and
  goes on, so one run finds them all;
* ``host build``: an op computing on the CPU from a model tensor the loader left there (or from such a result);
* ``host-to-device``: such a result copied to the compute device (bytes over the bus per call).

ComfyUI's own casts of offloaded weights (what lowvram means) are counted apart, not listed. Views are followed but
not counted. Where a model reads a value on the host (``float(sigma)``, ``.tolist()``, a boolean mask's positions), the
recorder answers from a real CPU shadow of that tensor, kept for small tensors computed only from the call's inputs
and constants (never from weights), so the control flow is the real one; a value that depends on weights stays
unknown and the model is listed as not audited. Each load is called twice and the second call is reported (per-call cost, not one-off copies such as a
fix's resident copy made on the first call). Each model runs twice:
pack off (stock) and pack on (the pack's fixes attached to the patcher as its loaders do). Models or load modes the
audit cannot run are listed as "not audited" with the reason.

In rooms: ``placement_recorder`` (the op recorder), ``placement_models`` (the catalogue of models and their calls),
``placement_runs`` (loads, runs, ``ACCEPTED``, the table), ``placement_audit_dynamic`` (ModelPatcherDynamic on a
fake device), ``placement_audit_files`` (users' files). Entry point: ``main(model_files, as_json)`` here
(``tools/doctor.py --audit``); ``placement_runs.audit()`` returns the rows. Needs ComfyUI importable
(``COMFYUI_PATH``); never imported by ComfyUI's start-up.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from ..contract.comfy import comfy_module
from . import placement_audit_files
from .comfyui_checkout import use_comfyui_checkout
from .placement_runs import audit, exit_code, table


def main(model_files: list[str], as_json: bool) -> int:
    """``tools/doctor.py --audit [FILES...]``: print the audit of the built-in configurations, or of the models in
    ``model_files`` (``placement_audit_files``); exit 1 when the pack leaves a finding it does not accept, 2 when
    ComfyUI is not importable or a file cannot be audited."""
    use_comfyui_checkout()
    if comfy_module("comfy.model_patcher") is None:
        print("placement audit: needs ComfyUI (set COMFYUI_PATH to a ComfyUI checkout and run with its Python)",
              file=sys.stderr)
        return 2
    if model_files:
        return placement_audit_files.main(model_files, as_json)
    rows = audit(show_progress=True)
    print(json.dumps([asdict(r) for r in rows], indent=1) if as_json else table(rows))
    return exit_code(rows)
