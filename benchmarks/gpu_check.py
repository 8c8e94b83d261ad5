"""The opt-in GPU check: the end-to-end seed scenarios on real CUDA, the Music 3 CUDA-graph check and the doctor, in
one command and one report, for the day an NVIDIA GPU is at hand (never in CI; about 7 minutes, at most 10).

    python benchmarks/gpu_check.py --comfyui PATH [--out report.json]

Run it with the Python of the ComfyUI at PATH (its requirements and a CUDA build of torch installed).

1. scenarios: every scenario of tests/hotfix_testing/seed_scenarios.py, the list the simulated-device tests run, at each of its
   budgets, once in a server without the pack (stock loaders) and once with it (the pack's), with the scenario's
   loader: dynamic VRAM (ComfyUI's default on NVIDIA) or the legacy one (``--disable-dynamic-vram``), on that
   ComfyUI as it is: ``--reserve-vram`` is set so that ComfyUI's own free-memory reading (``torch.cuda.mem_get_info`` in the
   server, read from ``/system_stats`` of a first server) leaves exactly the scenario's resident MB beyond
   ``minimum_inference_memory()``, so ComfyUI itself decides the partial loads; ``NVIDIA_TF32_OVERRIDE=0`` and fp32
   so that outputs compare with an all-CPU (``--cpu``) run of the same graph. The multi-device scenarios need two
   CUDA devices, otherwise they are reported skipped; "models on device 1" runs with ``--default-device 1``, which
   in ComfyUI renumbers the devices so that the second GPU is ``cuda:0`` in the server: it checks the second card,
   not a model on a device index other than 0 (that case is the simulated device's, ``npu:1``); the split one puts
   the video VAE on ``cuda:1`` with ComfyUI's Select VAE Device;
2. seed 001 (``vision_tower_part``): the H3 reference-to-video conditioning with the tiny text encoder on the GPU
   (fp32: ``--fp32-text-enc``, since ``--force-fp32`` keeps text encoders on the CPU), at the budgets of
   tests/hotfix_testing/seed_scenarios.py's ``VISION_TOWER_RESIDENT_MB``, in servers that keep their models between prompts;
3. benchmarks/music3_graph_capture.py (its ``main``): graph replay noise, capture policy, speed, pinning;
4. benchmarks/h3_fp16_overflow.py (its ``main``): the H3 DiT at the real block width in fp32 (TF32 off), plain fp16
   and fp16 with the fix: per-step times, the fix's overhead, the fp16 gain, memory;
5. ``tools/doctor.py --json`` against that ComfyUI (``COMFYUI_PATH``).

A scenario run passes when the pack's run completes, equals the CPU run within TOLERANCE, the budget split the
models as intended (legacy loader: a partial load logged at the "partial" and "smallest" budgets, except where
ComfyUI never splits them: Music 3's text encoder and DAV; dynamic VRAM logs no partial loads), and the scenario's fix, where the start-up log says it is needed on that core,
hooked more than 0 modules. The stock runs are reported, not
judged: whether they fail depends on the ComfyUI core at PATH.

Exit status: 0 every check passed, 1 a check failed, 2 the check cannot run here (no CUDA, no ComfyUI at PATH).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "tests")]  # run by path: the pack (tools/minimax_hotfix) and the tests' helpers (hotfix_testing), as pytest's pythonpath
CANNOT_RUN = 2
MB = 2**20
INFERENCE_MB = 0.8 * 1024  # minimum_inference_memory() less the reserve: ComfyUI's fixed part
TOLERANCE = 1e-3  # fp32 on CUDA, TF32 off, against the CPU: reduction order only
PARTIAL_BUDGETS = ("partial", "smallest")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", type=Path, required=True, help="the ComfyUI checkout to run (its main.py)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_report.json"),
                        help="the JSON report (default gpu_check_report.json)")
    return parser.parse_args(argv)


def cannot_run(args) -> str | None:
    """The one line that says why the check cannot run here, None when it can."""
    if not torch.cuda.is_available():
        return ("gpu_check: needs CUDA: no CUDA device in this Python (torch "
                f"{torch.__version__}); the same scenarios run on the simulated device in "
                "tests/test_seed_scenarios_on_device.py")
    if not (args.comfyui / "main.py").is_file():
        return f"gpu_check: no ComfyUI at {args.comfyui} (main.py not found)"
    from minimax_hotfix.diagnostics.comfyui_checkout import (
        ComfyUIUnavailable,
        use_comfyui_checkout,
    )

    try:
        use_comfyui_checkout(str(args.comfyui))
    except ComfyUIUnavailable as exc:
        return f"gpu_check: {exc}"
    return None


def plan(device_count: int) -> list[dict]:
    """Every run of the scenario part: scenario x budget x loaders, with the server it needs (device index,
    resident MB), or why it is skipped."""
    from hotfix_testing import seed_scenarios

    runs = []
    for scenario in seed_scenarios.SCENARIOS:
        if not scenario.int_mm:
            skipped = "needs a device without torch._int_mm (the simulated one stands for MPS); CUDA has it"
        elif scenario.devices_needed > device_count:
            skipped = f"needs {scenario.devices_needed} CUDA devices, {device_count} here"
        else:
            skipped = None
        for budget, resident_mb in scenario.resident_mb.items():
            for pack in (False, True):
                runs.append({"scenario": scenario, "budget": budget, "pack": pack, "index": scenario.device_index,
                             "resident_mb": resident_mb, "skipped": skipped})
    return runs


def reserve_vram_gb(free_mb: float, resident_mb: float) -> float:
    """``--reserve-vram`` that leaves ``resident_mb`` of ``free_mb`` beyond ComfyUI's minimum inference memory."""
    return max(0.0, free_mb - INFERENCE_MB - resident_mb) / 1024


@contextlib.contextmanager
def server(comfyui: Path, models: Path, work: Path, device, pack: bool, cache: bool = False):
    """A ComfyUI serving ``models``; ``--cache-none`` unless ``cache`` (then it keeps its models between prompts)."""
    from hotfix_testing.comfyui_server import comfyui_with_pack

    base = Path(tempfile.mkdtemp(dir=work, prefix="server"))
    (base / "models").symlink_to(models, target_is_directory=True)
    with comfyui_with_pack(comfyui, base, ROOT / "tests" / "comfyui_probe", options=() if cache else ("--cache-none",),
                           device=device, pack=pack) as (url, object_info):
        yield url, object_info, base


def free_mb_on(comfyui: Path, models: Path, work: Path, index: int) -> float:
    """ComfyUI's own free-memory reading on ``cuda:index`` in an idle server (its CUDA context already counted)."""
    from hotfix_testing.comfyui_server import CudaDevice, http

    with server(comfyui, models, work, CudaDevice(index=index), pack=True) as (url, _, _):
        devices = json.loads(http(url + "/system_stats")[1])["devices"]
        (entry,) = [entry for entry in devices if entry["type"] == "cuda" and entry["index"] == index]
        return entry["vram_free"] / MB


def scenario_part(args, work: Path) -> tuple[list[dict], int]:
    from hotfix_testing import scenario_table, seed_scenarios, synthetic_models
    from hotfix_testing.comfyui_server import CudaDevice

    models = work / "models"
    synthetic_models.write_models(models)  # with that ComfyUI's own classes (cannot_run made it importable)
    runs = plan(torch.cuda.device_count())
    references = {}
    with server(args.comfyui, models, work, None, pack=True) as cpu:
        for scenario in seed_scenarios.SCENARIOS:
            key = (scenario.workflow, scenario.make_prompt, scenario.probes)
            if key not in references:
                result = seed_scenarios.run(cpu, seed_scenarios.workflows(scenario.workflow)[0],
                                            f"cpu_{len(references)}", make_prompt=scenario.make_prompt,
                                            probes=scenario.probes)
                references[key] = result
                print(f"CPU reference of {scenario.workflow.name}: {result['error'] or 'completed'}", flush=True)
    free = {index: free_mb_on(args.comfyui, models, work, index)
            for index in sorted({run["index"] for run in runs if not run["skipped"]})}
    print("free as ComfyUI reads it: " + ", ".join(f"cuda:{i} {mb:.0f} MB" for i, mb in free.items()), flush=True)
    rows, failed = [], 0
    def server_of(run: dict) -> tuple:
        return run["pack"], run["index"], run["resident_mb"], run["scenario"].loader

    for pack, index, resident_mb, loader in sorted({server_of(run) for run in runs if not run["skipped"]}):
        device = CudaDevice(reserve_vram_gb=reserve_vram_gb(free[index], resident_mb), index=index,
                            dynamic_vram=loader == "dynamic")
        with server(args.comfyui, models, work, device, pack) as running:
            for run in runs:
                if server_of(run) != (pack, index, resident_mb, loader) or run["skipped"]:
                    continue
                scenario = run["scenario"]
                reference = references[(scenario.workflow, scenario.make_prompt, scenario.probes)]
                workflow = seed_scenarios.workflows(scenario.workflow)[0 if pack else 1]
                tag = f"{scenario.test}_{run['budget']}_{'pack' if pack else 'stock'}"
                result = {**seed_scenarios.run(running, workflow, tag, make_prompt=scenario.make_prompt,
                                               probes=scenario.probes), "loader": loader}
                loaders = "pack" if pack else "stock (server without the pack)"
                diff = (seed_scenarios.record(scenario.name, "given ComfyUI", run["budget"], loaders, result,
                                              reference["tensors"], scenario.compared)
                        if reference["error"] is None else None)
                split = any("partial" in load for load in result["loads"])
                hooks = seed_scenarios.hook_counts(result["fix_lines"])
                state = seed_scenarios.fix_state(running[2], scenario.fix.split("@")[0]) if scenario.fix else None
                verdict = "reported"
                if pack:
                    passed = (result["error"] is None and diff is not None and diff <= TOLERANCE
                              and (split or not scenario.splits or scenario.loader == "dynamic"
                                   or run["budget"] not in PARTIAL_BUDGETS)
                              and (state != "needed" or hooks.get(scenario.fix, 0) > 0))
                    verdict = "pass" if passed else "FAIL"
                    failed += not passed
                rows.append({"scenario": scenario.name, "budget": run["budget"], "loader": loader, "loaders": loaders,
                             "reserve_vram_gb": device.reserve_vram_gb, "device": f"cuda:{index}",
                             "error": result["error"], "loads": result["loads"], "partial_load": split,
                             "hooks": hooks, "fix_state": state, "max_abs_diff": diff,
                             "verdict": verdict})
    for run in runs:
        if run["skipped"]:
            rows.append({"scenario": run["scenario"].name, "budget": run["budget"],
                         "loaders": "pack" if run["pack"] else "stock (server without the pack)",
                         "verdict": f"skipped: {run['skipped']}"})
    print("\n".join(scenario_table.lines()), flush=True)
    return rows, failed


def vision_tower_part(args, work: Path) -> tuple[list[dict], int]:
    """Seed 001 (tests/hotfix_testing/seed_scenarios.py, ``VISION_TOWER_*``): the H3 reference-to-video conditioning with the tiny
    text encoder on the GPU in fp32, at each budget, in a server without the pack and one with it that keep their
    models between prompts, both canvases and prompt texts, against a ``--cpu`` server. A pack run passes when every
    prompt completes and equals the CPU's, the budget split the encoder as intended, and each qwen3vl fix the
    start-up log calls needed hooked. CUDA has no host-to-device counter here: the bytes per prompt are the simulated
    device's (tests/test_h3_vision_tower_on_device.py)."""
    from hotfix_testing import seed_scenarios, synthetic_models
    from hotfix_testing.comfyui_server import CudaDevice

    models = work / "vision_tower_models"
    synthetic_models.write_vision_tower_models(models)
    pack_workflow, stock_workflow = seed_scenarios.workflows(seed_scenarios.H3_REFERENCE_TO_VIDEO)
    prompts = [(canvas, text) for canvas in seed_scenarios.VISION_TOWER_CANVASES
               for text in seed_scenarios.VISION_TOWER_PROMPTS]
    with server(args.comfyui, models, work, None, pack=True, cache=True) as cpu:
        reference = [seed_scenarios.run_vision_tower(cpu, pack_workflow, text, canvas, f"cpu_{i}")["conditioning"]
                     for i, (canvas, text) in enumerate(prompts)]
    free = free_mb_on(args.comfyui, models, work, 0)
    rows, failed = [], 0
    for budget, resident_mb in seed_scenarios.VISION_TOWER_RESIDENT_MB.items():
        for pack in (False, True):
            device = CudaDevice(reserve_vram_gb=reserve_vram_gb(free, resident_mb), text_encoder=True)
            loaders = "pack" if pack else "stock (server without the pack)"
            with server(args.comfyui, models, work, device, pack, cache=True) as running:
                results = [seed_scenarios.run_vision_tower(running, pack_workflow if pack else stock_workflow, text,
                                                           canvas, f"{budget}_{'pack' if pack else 'stock'}_{i}")
                           for i, (canvas, text) in enumerate(prompts)]
                states = {fix: seed_scenarios.fix_state(running[2], fix) for fix in seed_scenarios.VISION_TOWER_FIXES}
            errors = [result["error"] for result in results if result["error"]]
            diffs = [(result["conditioning"] - expected).abs().max().item()
                     for result, expected in zip(results, reference, strict=True)
                     if result["conditioning"] is not None and expected is not None]
            diff = max(diffs) if len(diffs) == len(prompts) else None
            hooks = {}
            for result in results:
                hooks.update({key: count for key, count in seed_scenarios.hook_counts(result["fix_lines"]).items()
                              if count})
            split = any("partial" in load for result in results for load in result["loads"])
            verdict = "reported"
            if pack:
                hooked = {key.split("@")[0] for key in hooks}
                passed = (not errors and diff is not None and diff <= TOLERANCE
                          and (split or budget not in PARTIAL_BUDGETS)
                          and all(fix in hooked for fix, state in states.items() if state == "needed"))
                verdict = "pass" if passed else "FAIL"
                failed += not passed
            rows.append({"scenario": seed_scenarios.VISION_TOWER, "budget": budget, "loaders": loaders,
                         "reserve_vram_gb": device.reserve_vram_gb, "errors": errors,
                         "loads": [result["loads"] for result in results], "partial_load": split, "hooks": hooks,
                         "fix_state": states, "max_abs_diff": diff, "verdict": verdict})
            print(f"{seed_scenarios.VISION_TOWER} | {budget} | {loaders} | {errors[0] if errors else 'completed'} | "
                  f"diff {diff} | {verdict}", flush=True)
    return rows, failed


def benchmark_part(name: str, work: Path) -> tuple[dict, int]:
    """benchmarks/NAME.py's ``main`` at its CUDA defaults: its exit code and its figures."""
    module = importlib.import_module(f"minimax_hotfix.benchmarks.{name}")
    figures = work / f"{name}.json"
    status = module.main(["--json", str(figures)])
    return {"exit_code": status, **(json.loads(figures.read_text()) if figures.exists() else {})}, int(status != 0)


def doctor_part(comfyui: Path) -> tuple[dict, int]:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "doctor.py"), "--json"], check=False, capture_output=True,
                          text=True, env={**os.environ, "COMFYUI_PATH": str(comfyui)}, timeout=300)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        report = {"stdout": done.stdout[-2000:], "stderr": done.stderr[-2000:]}
    print(f"doctor --json: exit {done.returncode}", flush=True)
    return {"exit_code": done.returncode, "report": report}, int(done.returncode != 0)


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = cannot_run(args)
    if reason:
        print(reason)
        return CANNOT_RUN
    started = time.monotonic()
    report = {"torch": torch.__version__, "cuda": torch.version.cuda, "comfyui": str(args.comfyui.resolve()),
              "devices": [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())],
              "tolerance": TOLERANCE}
    failed = 0
    with tempfile.TemporaryDirectory(prefix="minimax-hotfix-gpu-check-") as work:
        for part, run_part in (("scenarios", lambda: scenario_part(args, Path(work))),
                               ("vision_tower", lambda: vision_tower_part(args, Path(work))),
                               ("music3_graph_capture", lambda: benchmark_part("music3_graph_capture", Path(work))),
                               ("h3_fp16_overflow", lambda: benchmark_part("h3_fp16_overflow", Path(work))),
                               ("doctor", lambda: doctor_part(args.comfyui))):
            part_started = time.monotonic()
            report[part], part_failed = run_part()
            report[f"{part}_wall_s"] = round(time.monotonic() - part_started, 1)
            failed += part_failed
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["failed_checks"] = failed
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"{'all checks passed' if not failed else f'{failed} check(s) failed'} in {report['wall_s']} s; "
          f"report: {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
