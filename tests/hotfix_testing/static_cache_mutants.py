"""Runs the ``transformers_static_cache`` mutants of hotfix_testing/mutated_cores.py in one Python process on the
simulated accelerator, with the transformers the test run has first on the path (5.19: both bugs). No ComfyUI: the fix
is process-wide, and ComfyUI never calls ``generate()`` itself; a custom node in its process does.

For each mutant named on the command line: its function edits take the place of transformers' methods, the fix is
detected afresh (its probes included, run before the device's dispatch mode, as on hardware where none exists), and
the half of seed 003 its scenario names runs three times: on the CPU (the reference), on ``npu:0`` without the pack
(stock), and with the pack's process-wide fixes installed as ComfyUI's start-up installs them (pack):
* ``static_cache_masks``: ``generate(cache_implementation="static")`` of a tiny Gemma 3 and a tiny Qwen3 with the
  inputs in CPU RAM (hotfix_testing/generate_on_simulated_device.py): the ids;
* ``static_cache_tp_heads``: the KV heads of the static cache that ``generate()`` initializes early
  (``prefill_chunk_size``) for a TP size of 2 and a plan that gathers k/v, so each rank computes every head; the
  reference is the model without TP.
One JSON line per mutant on stdout, prefixed ``MUTANT``, in the form mutant_runs.py gives.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import _disable_current_modes

from hotfix_testing import mutated_cores
from hotfix_testing.generate_on_simulated_device import GENERATE, PADDED, PROMPT, TINY_MODELS, simulated_accelerator
from hotfix_testing.registry_state import forget_detection
from minimax_hotfix import registry
from minimax_hotfix.contract import error_line
from minimax_hotfix.patches import transformers_static_cache as shim

WORK = Path(tempfile.mkdtemp(prefix="static-cache-mutants-"))
CPU = torch.device("cpu")
TP_SIZE = 2
GATHERED_KV = {"model.layers.*.self_attn.k_proj": "colwise_gather_output",
               "model.layers.*.self_attn.v_proj": "colwise_gather_output"}


def early_cache_heads(tensor_parallel: bool) -> int:
    """The KV heads per layer of the static cache ``generate()`` initializes early for a tiny Qwen3 (2 KV heads)."""
    model = TINY_MODELS["qwen3"]()
    if tensor_parallel:
        model._tp_size = TP_SIZE
        model.tp_plan = GATHERED_KV
    cache = model._prepare_static_cache("static", batch_size=1, max_cache_len=16, prefill_chunk_size=4,
                                        model_kwargs={})
    return cache.layers[0].keys.shape[1]


def generated_ids(device: torch.device) -> torch.Tensor:
    return torch.cat([make().to(device).generate(input_ids=PROMPT, attention_mask=PADDED, **GENERATE).flatten()
                      for make in TINY_MODELS.values()]).to(CPU)


SCENARIOS = {"static_cache_masks": generated_ids,
             "static_cache_tp_heads": lambda device: torch.tensor([early_cache_heads(tensor_parallel=device != CPU)])}


def seed_003(scenario: str, device: torch.device, accelerator) -> dict:
    """The scenario's half of the seed on ``device``: ``output`` or ``error``, and the host-to-device bytes."""
    accelerator.reset_counters()
    try:
        result = {"output": SCENARIOS[scenario](device)}
    except Exception as exc:  # noqa: BLE001  (the outcome of the run is what is measured)
        result = {"error": error_line(exc)}
    result["h2d"] = sum(nbytes for _, nbytes in accelerator.host_to_device().values())
    return result


def run_mutant(mutant: mutated_cores.Mutant, accelerator, device: torch.device) -> dict:
    record = {"mutant": mutant.name}
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(mutated_cores.functions_edited(mutant, WORK / str(len(list(WORK.iterdir())))))
        except Exception as exc:  # noqa: BLE001
            record["core_error"] = error_line(exc)
            return record
        registry.uninstall_process_fixes()
        shim.FIX._verdict = None  # detected afresh on this mutant
        forget_detection(registry)
        try:
            with _disable_current_modes():
                shim.FIX.verdict()
            found = registry.status(shim.FIX)
            record["state"], record["reason"] = found.state.value, found.reason
        except Exception:  # noqa: BLE001
            record["pack_traceback"] = traceback.format_exc()
            return record
        reference = seed_003(mutant.scenario, CPU, accelerator)
        if "error" in reference:
            record["invalid"] = f"the CPU reference run fails: {reference['error']}"
            return record
        runs = {"stock": seed_003(mutant.scenario, device, accelerator)}
        problems = mutated_cores.Problems()
        logging.getLogger().addHandler(problems)
        try:
            attached = registry.install_process_fixes()
            runs["pack"] = seed_003(mutant.scenario, device, accelerator) | {"attached": attached}
        except Exception:  # noqa: BLE001
            record["pack_traceback"] = traceback.format_exc()
            return record
        finally:
            registry.uninstall_process_fixes()
            logging.getLogger().removeHandler(problems)
        record.update(mutated_cores.compared(runs, reference["output"]))
        record["startup"] = {"problems": problems.found}
    return record


def main(names: list[str]) -> None:
    import transformers

    transformers.logging.set_verbosity_error()  # generate()'s advice about host-side inputs, given on purpose here
    accelerator = simulated_accelerator()
    accelerator.install()
    accelerator.enter_in_every_thread()
    device = torch.device(accelerator.DEVICE_TYPE, 0)
    for name in names:
        print("MUTANT " + json.dumps(run_mutant(mutated_cores.named(name), accelerator, device)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
