"""The opt-in GPU check: the end-to-end seed scenarios on real CUDA, the Music 3 CUDA-graph check, the H3 fp16
benchmark and the doctor, in one command and one report, for the day an NVIDIA GPU is at hand (never in CI; about 7
minutes is the goal, at most 10).

    python benchmarks/gpu_check.py --comfyui PATH [--out report.json] [--parts scenarios,vision_tower,...] [--servers N]

Run it with the Python of the ComfyUI at PATH (its requirements and a CUDA build of torch installed; a bare machine:
docs/testing.md, "A bare CUDA machine"). The report is written again, whole, after each part; a part that raises is
reported as one failed check and the others go on.

The parts that only judge (1, 2, 3, 7) run side by side, and so do their servers, at most ``--servers`` at once: each
CUDA server reads its free memory as if it were alone on the GPU (tests/hotfix_testing/pinned_free_memory.py), so a
neighbour's loads do not move its budgets. The parts that time the GPU (4, 5, 6: TIMED_PARTS) run after them, one at
a time, alone on it.

1. scenarios: every scenario of tests/hotfix_testing/seed_scenarios.py, the list the simulated-device tests run, at
   each of its budgets, stock (a server without the pack) and pack, with the scenario's loader: dynamic VRAM
   (ComfyUI's default on NVIDIA) or the legacy one (``--disable-dynamic-vram``), on that ComfyUI as it is. One server
   per (loaders, device, memory manager) serves every budget: ``set_budget`` sets ``--reserve-vram`` on it through
   the probe node before each prompt, so that ComfyUI's own free-memory reading leaves the budget's resident MB
   beyond ``minimum_inference_memory()`` and ComfyUI itself decides the partial loads; "full" reserves nothing.
   ``NVIDIA_TF32_OVERRIDE=0`` and fp32. The ``--cpu`` references run beside the GPU servers. Multi-device scenarios
   need two CUDA devices, otherwise they are reported skipped; "models on device 1" runs with ``--default-device 1``,
   which in ComfyUI renumbers the devices so that the second GPU is ``cuda:0`` in the server: it checks the second
   card, not a model on a device index other than 0 (that case is the simulated device's, ``npu:1``); the split one
   puts the video VAE on ``cuda:1`` with ComfyUI's Select VAE Device;
2. h3_divergence: where a GPU and the CPU part on MiniMax H3: seed 000's graph, stock, every model loaded
   completely, once in a CUDA server and once in a ``--cpu`` one, with every module call traced (the probe's
   ``/probe/trace``): the first call whose output differs (``first_divergence``) names the module, and its place
   in the run the node and step;
3. vision_tower, seed 001: the H3 reference-to-video conditioning with the tiny text encoder on the GPU (fp32:
   ``--fp32-text-enc``, since ``--force-fp32`` keeps text encoders on the CPU), at the budgets of
   tests/hotfix_testing/seed_scenarios.py's ``VISION_TOWER_RESIDENT_MB``, in servers that keep their models between
   prompts;
4. music3_graph_capture: benchmarks/music3_graph_capture.py (its ``main``): graph replay noise, capture policy,
   speed, pinning;
5. music3_graphs_comfyui: the Music 3 workflow through ComfyUI's own AR loop with CUDA graphs, under dynamic VRAM with
   the text encoder on the GPU, on the simulated cores MUSIC3_GRAPH_CORES (built from ../shared/comfyui beside the
   checkout), stock and pack, each with graphs on and off (``--disable-cuda-graphs`` set on the running server):
   stock's stale-replay noise where the fix is needed, the pack equal to graphs off with its units captured, a no-op
   where upstream fixed it, and the time per AR frame both ways; and on the fixed core the bundled GGUF workflow,
   its Q4_0 text encoder through ComfyUI-GGUF's Dynamic VRAM loader (the tests' stand-in,
   tests/comfyui_gguf_stand_in): stock's capture error, the pack's policy leaving that unit uncaptured and the
   others graphed, equal to graphs off (``music3_graphs_part``);
6. h3_fp16_overflow: benchmarks/h3_fp16_overflow.py (its ``main``): the H3 DiT at the real block width in fp32 (TF32
   off), plain fp16, fp16 with the fix and the fix without its safety net: per-step times, the fix's and the net's
   overheads, the fp16 gain, memory;
7. doctor: ``tools/doctor.py --json`` against that ComfyUI (``COMFYUI_PATH``).

A pack run passes (``judge``) when it completes, ComfyUI loaded every model completely at "full" and split them at
"partial" and "smallest" (legacy loader, except where ComfyUI never splits them: Music 3's text encoder and DAV), the
scenario's fix, where the start-up log says it is needed, hooked more than 0 modules, and its outputs equal, key by
key, stock's fault-free run on the same device (stock at "full", every model loaded) within SAME_DEVICE_TOLERANCE,
and the CPU's within TOLERANCE on the keys where that fault-free run equals the CPU's. The stock runs are reported,
not judged: whether they fail depends on the ComfyUI core at PATH.

Exit status: 0 every check passed, 1 a check failed, 2 the check cannot run here (no CUDA, no ComfyUI at PATH).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "tests")]  # run by path: the pack (tools/minimax_hotfix) and the tests' helpers (hotfix_testing), as pytest's pythonpath
from minimax_hotfix.diagnostics.emulated_capture import CAPTURE_HOST_COPY_ERROR  # noqa: E402

CANNOT_RUN = 2
MB = 2**20
INFERENCE_MB = 0.8 * 1024  # minimum_inference_memory() less the reserve: ComfyUI's fixed part
# fp32, TF32 off, against the CPU, on the keys where the device's own fault-free run holds it: an output that rounding
# alone can move further (the old synthetic H3 audio VAE's: 0.376 on an H200, docs/testing.md, "The GPU check") is
# judged on the device only.
TOLERANCE = 1e-3
# The pack's run against stock's fault-free run on the same device: the same kernels on the same values (a partial
# load casts the same weights per layer), so bit for bit on the simulated device (tests/test_gpu_check.py); the room
# is for cuBLAS choosing another fp32 algorithm between loads, about 1e-6 relative per op.
SAME_DEVICE_TOLERANCE = 1e-5
PARTS = ("scenarios", "h3_divergence", "vision_tower", "music3_graph_capture", "music3_graphs_comfyui",
         "h3_fp16_overflow", "doctor")
# the parts that time the GPU: they run one at a time, after the others, alone on it; the others run side by side
TIMED_PARTS = ("music3_graph_capture", "music3_graphs_comfyui", "h3_fp16_overflow")
# the parts that serve the synthetic models: written once, before they start side by side
SYNTHETIC_MODEL_PARTS = {"scenarios", "h3_divergence", "music3_graphs_comfyui"}
# the cores of the Music 3 CUDA-graph part: stale replay without the pack (#15861 before #16428), and fixed upstream
MUSIC3_GRAPH_CORES = ("post-#15861 Music 3", "fixed Music 3")
# seed 002's other half, on the fixed core (no noise to tell apart): the bundled GGUF workflow, its Q4_0 text encoder
# from ComfyUI-GGUF's Dynamic VRAM loader (the tests' stand-in); stock with graphs on meets the capture error
MUSIC3_GGUF_CORE = "fixed Music 3"
MUSIC3_GGUF_RUNS = f"{MUSIC3_GGUF_CORE}, GGUF Q4_0 text encoder"
MUSIC3_GGUF_WORKFLOW = ROOT / "workflows" / "MiniMax Music 3 with a GGUF text encoder.json"
# 250 AR frames (25 a second): enough that the per-frame time is the steady state's, not the first frames' captures
MUSIC3_GRAPH_SECONDS = 10.0
PARTIAL_BUDGETS = ("partial", "smallest")
# a module call's output parts from the CPU's when its L1 norm or largest magnitude differs by more than this,
# relative: another reduction order moves them by about 1e-7 (the simulated device's last-bit mode)
DIVERGENCE = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", type=Path, required=True, help="the ComfyUI checkout to run (its main.py)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_report.json"),
                        help="the JSON report, written again after each part (default gpu_check_report.json)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"the parts to run, comma-separated (default all: {','.join(PARTS)}); those that time "
                             f"the GPU ({','.join(TIMED_PARTS)}) run after the others, one at a time")
    parser.add_argument("--servers", type=int, default=max(2, (os.cpu_count() or 2) - 2),
                        help="at most this many ComfyUI servers at once (default: the machine's cores less 2)")
    args = parser.parse_args(argv)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        parser.error(f"--parts: unknown {', '.join(unknown) or '(none given)'}; the parts are {', '.join(PARTS)}")
    if args.servers < 1:
        parser.error(f"--servers: at least 1 (a server must be able to start), not {args.servers}")
    args.servers = Servers(args.servers)
    return args


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
    resident MB), or why it is skipped; a scenario without a "full" budget gets a stock run there, its fault-free
    run on the device (``judge``)."""
    from hotfix_testing import seed_scenarios

    runs = []
    for scenario in seed_scenarios.SCENARIOS:
        if not scenario.int_mm:
            skipped = "needs a device without torch._int_mm (the simulated one stands for MPS); CUDA has it"
        elif scenario.devices_needed > device_count:
            skipped = f"needs {scenario.devices_needed} CUDA devices, {device_count} here"
        else:
            skipped = None
        budgets = {"full": None, **scenario.resident_mb}
        for budget, resident_mb in budgets.items():
            for pack in (False,) if budget not in scenario.resident_mb else (False, True):
                runs.append({"scenario": scenario, "budget": budget, "pack": pack, "index": scenario.device_index,
                             "resident_mb": resident_mb, "skipped": skipped})
    return runs


def reserve_vram_gb(free_mb: float, resident_mb: float) -> float:
    """``--reserve-vram`` that leaves ``resident_mb`` of ``free_mb`` beyond ComfyUI's minimum inference memory."""
    return max(0.0, free_mb - INFERENCE_MB - resident_mb) / 1024


def set_budget(url: str, free_mb: float, budget: str, resident_mb: float) -> float:
    """Sets the running server's ``--reserve-vram`` for ``budget`` (through the probe node; ComfyUI reads it at every
    load) and returns it: "full" reserves nothing, so that ComfyUI loads every model completely (its VAE decode
    estimates exceed any small resident budget), the others leave ``resident_mb`` of ``free_mb``."""
    from hotfix_testing.comfyui_server import http

    gb = 0.0 if budget == "full" else reserve_vram_gb(free_mb, resident_mb)
    status, body = http(url + "/probe/reserve_vram", {"gb": gb})
    assert status == 200, body.decode()
    return gb


class Servers:
    """The check's ComfyUI servers, at most ``at_once`` running together (``--servers``). On the GPU each reads its
    free memory as if alone there (``comfyui_server.CudaDevice``), so servers side by side keep their budgets."""

    def __init__(self, at_once: int):
        self._slots = threading.BoundedSemaphore(at_once)

    @contextlib.contextmanager
    def start(self, comfyui: Path, models: Path, work: Path, device, pack: bool, cache: bool = False):
        """A ComfyUI serving ``models``; ``--cache-none`` unless ``cache`` (then it keeps its models between
        prompts). Waits for a slot: nothing may wait on another server while it holds one."""
        from hotfix_testing.comfyui_server import comfyui_with_pack

        base = Path(tempfile.mkdtemp(dir=work, prefix="server"))
        (base / "models").symlink_to(models, target_is_directory=True)
        no_frontend = base / "no_frontend"  # the check needs no frontend: ComfyUI serves this empty folder instead
        no_frontend.mkdir()
        options = ("--front-end-root", str(no_frontend), *(() if cache else ("--cache-none",)))
        with self._slots, comfyui_with_pack(comfyui, base, ROOT / "tests" / "comfyui_probe", options=options,
                                            device=device, pack=pack) as (url, object_info):
            yield url, object_info, base


def free_mb_of(url: str, index: int) -> float:
    """ComfyUI's own free-memory reading on ``cuda:index`` in an idle server (its CUDA context already counted)."""
    from hotfix_testing.comfyui_server import http

    devices = json.loads(http(url + "/system_stats")[1])["devices"]
    (entry,) = [entry for entry in devices if entry["type"] == "cuda" and entry["index"] == index]
    return entry["vram_free"] / MB


def synthetic_models_in(work: Path) -> Path:
    """The synthetic models folder the scenario, H3 divergence and Music 3 graph parts serve, written once per run
    (with that ComfyUI's own classes: ``cannot_run`` made it importable)."""
    from hotfix_testing import synthetic_models

    models = work / "models"
    if not models.exists():
        synthetic_models.write_models(models)
    return models


def side_by_side(*works) -> list:
    """Runs each of ``works`` in its own thread (their servers side by side, as many at once as ``Servers`` lets) and
    returns their results in order; the first exception is raised once every work has ended."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(works)) as pool:
        futures = [pool.submit(work) for work in works]
    return [future.result() for future in futures]


def per_key(tensors: dict, reference: dict | None, compared) -> dict[str, float | None]:
    """Max abs diff of each compared output from ``reference``'s; None where either lacks it."""
    return {name: (tensors[name] - reference[name]).abs().max().item()
            if reference is not None and name in tensors and name in reference else None for name in compared}


def within(diffs: dict, tolerance: float) -> bool:
    return all(diff is not None and diff <= tolerance for diff in diffs.values())


def judge(runs: list[dict], cpu_references: dict) -> tuple[list[dict], int]:
    """The report's rows and the number of failed pack runs.

    A run is a dict: ``name``, ``group`` (the runs that share a device and a loader), ``budget``, ``pack``,
    ``result`` (``error``, ``tensors``, ``loads``, ``fix_lines``), ``compared``, ``cpu`` (the key of its CPU
    reference), ``split_expected``, ``needed`` (the fixes that must hook where the start-up log calls them needed),
    and what the row reports besides. Each pack run is judged against its group's fault-free run on the same device:
    stock at the "full" budget, completed, every model loaded completely (ComfyUI's own load lines), within
    SAME_DEVICE_TOLERANCE on every key; against the CPU only on the keys where that fault-free run itself equals
    the CPU within TOLERANCE. Where the group has none (stock failed or split at "full", or no "full" budget), the pack
    run is judged against the CPU on every key, and the row says so."""
    from hotfix_testing.seed_scenarios import hook_counts

    device_references = {}
    for run in runs:
        result = run["result"]
        if (not run["pack"] and run["budget"] == "full" and result["error"] is None
                and not any("partial" in load for load in result["loads"])):
            device_references[run["group"]] = result["tensors"]
    rows, failed = [], 0
    for run in runs:
        result, compared = run["result"], run["compared"]
        cpu = cpu_references.get(run["cpu"])
        vs_cpu = per_key(result["tensors"], cpu, compared)
        device_reference = device_references.get(run["group"])
        vs_device = per_key(result["tensors"], device_reference, compared) if device_reference is not None else None
        cpu_holds = sorted(name for name, diff in per_key(device_reference, cpu, compared).items()
                           if diff is not None and diff <= TOLERANCE) if device_reference is not None else None
        split = any("partial" in load for load in result["loads"])
        hooks = hook_counts(result["fix_lines"])
        hooked = {key for key, count in hooks.items() if count} | {key.split("@")[0] for key, count in hooks.items()
                                                                   if count}
        verdict = "reported"
        if run["pack"]:
            problems = []
            if result["error"] is not None:
                problems.append(f"error: {result['error'][:120]}")
            if run["budget"] == "full" and split:
                problems.append("not a full load at the full budget")
            if run["split_expected"] and not split:
                problems.append("no partial load at a partial budget")
            problems += [f"{fix} needed but hooked nothing" for fix, state in run["needed"].items()
                         if state == "needed" and fix not in hooked]
            if vs_device is not None:
                far = {k: d for k, d in vs_device.items() if d is None or d > SAME_DEVICE_TOLERANCE}
                far_cpu = {k: vs_cpu[k] for k in cpu_holds if vs_cpu[k] is None or vs_cpu[k] > TOLERANCE}
                problems += [f"differs from the fault-free run on this device: {far}"] * bool(far)
                problems += [f"differs from the CPU where this device's fault-free run does not: {far_cpu}"] * bool(
                    far_cpu)
            elif not within(vs_cpu, TOLERANCE):
                problems.append(f"no fault-free run on this device; differs from the CPU: {vs_cpu}")
            verdict = "pass" if not problems else "FAIL: " + "; ".join(problems)
            failed += bool(problems)
        elif run["budget"] == "full":
            verdict = ("reported; the fault-free run on this device" if run["group"] in device_references
                       else "reported; not fault-free (failed or split), no device reference for this group")
        diffs = vs_device if vs_device is not None else vs_cpu
        known = [diff for diff in diffs.values() if diff is not None]
        rows.append({"scenario": run["name"], "budget": run["budget"],
                     "loaders": "pack" if run["pack"] else "stock (server without the pack)",
                     **run["report"], "error": result["error"], "loads": result["loads"], "partial_load": split,
                     "hooks": hooks, "judged_against": "fault-free run on this device" if vs_device is not None
                     else "CPU", "max_abs_diff": max(known) if len(known) == len(diffs) else None,
                     "vs_device_reference": vs_device, "vs_cpu": vs_cpu, "cpu_holds_on": cpu_holds,
                     "verdict": verdict})
    return rows, failed


def scenario_runs(args, work: Path) -> tuple[list[dict], dict, list[dict]]:
    """Every run of the scenario part (``judge``'s runs), the CPU references by key, the skipped runs' rows. One
    server per (loaders, device, memory manager) serves every budget (``set_budget`` before each prompt); those
    servers and the one of the ``--cpu`` references run side by side."""
    from hotfix_testing import seed_scenarios
    from hotfix_testing.comfyui_server import CudaDevice

    models = synthetic_models_in(work)
    planned = plan(torch.cuda.device_count())

    def cpu_references() -> dict:
        references = {}
        with args.servers.start(args.comfyui, models, work, None, pack=True) as cpu:
            for scenario in seed_scenarios.SCENARIOS:
                key = (scenario.workflow, scenario.make_prompt, scenario.probes)
                if key not in references:
                    result = seed_scenarios.run(cpu, seed_scenarios.workflows(scenario.workflow)[0],
                                                f"cpu_{len(references)}", make_prompt=scenario.make_prompt,
                                                probes=scenario.probes)
                    references[key] = result["tensors"]
                    print(f"CPU reference of {scenario.workflow.name}: {result['error'] or 'completed'}", flush=True)
        return references

    def server_of(run: dict) -> tuple:
        return run["pack"], run["index"], run["scenario"].loader

    def group_runs(pack: bool, index: int, loader: str) -> list[dict]:
        runs = []
        device = CudaDevice(index=index, dynamic_vram=loader == "dynamic")
        with args.servers.start(args.comfyui, models, work, device, pack) as running:
            free = free_mb_of(running[0], index)
            print(f"{'pack' if pack else 'stock'} server, cuda:{index}, {loader}: {free:.0f} MB free as "
                  "ComfyUI reads it", flush=True)
            for run in planned:
                if server_of(run) != (pack, index, loader) or run["skipped"]:
                    continue
                scenario = run["scenario"]
                reserve = set_budget(running[0], free, run["budget"], run["resident_mb"])
                workflow = seed_scenarios.workflows(scenario.workflow)[0 if pack else 1]
                tag = f"{scenario.test}_{run['budget']}_{'pack' if pack else 'stock'}"
                result = seed_scenarios.run(running, workflow, tag, make_prompt=scenario.make_prompt,
                                            probes=scenario.probes)
                fix = scenario.fix.split("@")[0] if scenario.fix else None
                state = seed_scenarios.fix_state(running[2], fix) if fix else None
                runs.append({"name": scenario.name, "group": (scenario.name, index), "budget": run["budget"],
                             "pack": pack, "result": result, "compared": scenario.compared,
                             "cpu": (scenario.workflow, scenario.make_prompt, scenario.probes),
                             "split_expected": (scenario.splits and loader != "dynamic"
                                                and run["budget"] in PARTIAL_BUDGETS),
                             "needed": {scenario.fix: state} if fix else {},
                             "report": {"loader": loader, "reserve_vram_gb": reserve, "device": f"cuda:{index}",
                                        "fix_state": state}})
                print(f"{scenario.name} | {run['budget']} | {'pack' if pack else 'stock'} | "
                      f"{result['error'] or 'completed'} | loads {'/'.join(result['loads'])}", flush=True)
        return runs

    groups = sorted({server_of(run) for run in planned if not run["skipped"]})
    cpu, *by_group = side_by_side(cpu_references, *(functools.partial(group_runs, *group) for group in groups))
    runs = [run for group in by_group for run in group]
    skipped = [{"scenario": run["scenario"].name, "budget": run["budget"],
                "loaders": "pack" if run["pack"] else "stock (server without the pack)",
                "verdict": f"skipped: {run['skipped']}"} for run in planned if run["skipped"]]
    return runs, cpu, skipped


def scenario_part(args, work: Path) -> tuple[list[dict], int]:
    runs, cpu, skipped = scenario_runs(args, work)
    rows, failed = judge(runs, cpu)
    for row in rows:
        print(" | ".join(str(row[key]) for key in ("scenario", "budget", "loader", "loaders", "max_abs_diff",
                                                    "judged_against", "verdict")), flush=True)
    return rows + skipped, failed


def first_divergence(reference: list, trace: list, relative: float = DIVERGENCE) -> dict | None:
    """The first module call of ``trace`` (the probe's: class, output shape, L1 norm, largest magnitude) whose output
    differs from ``reference``'s same call by more than ``relative``, or where the two runs stop making the same
    calls; None where they agree throughout."""
    def close(a: float, b: float) -> bool:
        return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= relative * max(1.0, abs(a))

    for index, (expected, got) in enumerate(zip(reference, trace, strict=False)):
        if expected[:2] != got[:2]:
            return {"call": index, "why": "another module or shape", "cpu": expected, "device": got}
        if not (close(expected[2], got[2]) and close(expected[3], got[3])):
            return {"call": index, "why": "its output differs", "cpu": expected, "device": got,
                    "before": reference[max(0, index - 3):index]}
    if len(reference) != len(trace):
        return {"call": min(len(reference), len(trace)), "why": f"{len(reference)} calls on the CPU, {len(trace)} "
                                                                f"on the device"}
    return None


def traced_run(running, workflow: dict, scenario, tag: str) -> tuple[dict, list]:
    """``seed_scenarios.run`` with every module call traced: its result and the calls."""
    from hotfix_testing import seed_scenarios
    from hotfix_testing.comfyui_server import http

    http(running[0] + "/probe/trace", {"on": True})
    result = seed_scenarios.run(running, workflow, tag, make_prompt=scenario.make_prompt, probes=scenario.probes)
    return result, json.loads(http(running[0] + "/probe/trace", {"on": False})[1])["calls"]


def h3_divergence_part(args, work: Path) -> tuple[dict, int]:
    """Seed 000's graph with stock loaders, traced (``traced_run``) in a CUDA server (legacy loader, nothing
    reserved: every model loaded completely) and in a ``--cpu`` one beside it: per-key diffs and the first module
    call whose output differs (``first_divergence``). Reported, not judged."""
    from hotfix_testing import seed_scenarios
    from hotfix_testing.comfyui_server import CudaDevice

    models = synthetic_models_in(work)
    scenario = seed_scenarios.named("seed 000 H3 t2v")
    stock_workflow = seed_scenarios.workflows(scenario.workflow)[1]

    def on(device, tag: str) -> tuple[dict, list]:
        with args.servers.start(args.comfyui, models, work, device, pack=False) as running:
            return traced_run(running, stock_workflow, scenario, tag)

    (cpu_result, cpu_calls), (device_result, device_calls) = side_by_side(
        lambda: on(None, "divergence_cpu"), lambda: on(CudaDevice(), "divergence_device"))
    found = first_divergence(cpu_calls, device_calls)
    report = {"scenario": scenario.name, "errors": {"cpu": cpu_result["error"], "device": device_result["error"]},
              "loads": device_result["loads"], "calls": {"cpu": len(cpu_calls), "device": len(device_calls)},
              "vs_cpu": per_key(device_result["tensors"], cpu_result["tensors"], scenario.compared),
              "first_divergence": found}
    print(f"h3_divergence: {report['calls']} calls; per key {report['vs_cpu']}; first divergence: {found}", flush=True)
    return report, 0


def vision_tower_part(args, work: Path) -> tuple[list[dict], int]:
    """Seed 001 (tests/hotfix_testing/seed_scenarios.py, ``VISION_TOWER_*``): the H3 reference-to-video conditioning with the tiny
    text encoder on the GPU in fp32, at each budget, in a server without the pack and one with it that keep their
    models between prompts (unloaded when the budget changes), side by side with the CPU's, both canvases and prompt
    texts, judged as the scenario
    part's runs (``judge``: against stock at "full" on the device; the CPU where that holds). CUDA has no
    host-to-device counter here: the bytes per prompt are the simulated device's
    (tests/test_h3_vision_tower_on_device.py)."""
    from hotfix_testing import seed_scenarios, synthetic_models
    from hotfix_testing.comfyui_server import CudaDevice, unload_models

    models = work / "vision_tower_models"
    synthetic_models.write_vision_tower_models(models)
    pack_workflow, stock_workflow = seed_scenarios.workflows(seed_scenarios.H3_REFERENCE_TO_VIDEO)
    prompts = [(canvas, text) for canvas in seed_scenarios.VISION_TOWER_CANVASES
               for text in seed_scenarios.VISION_TOWER_PROMPTS]
    compared = tuple(f"prompt {i}" for i in range(len(prompts)))

    def conditionings(running, workflow, tag: str) -> dict:
        results = [seed_scenarios.run_vision_tower(running, workflow, text, canvas, f"{tag}_{i}")
                   for i, (canvas, text) in enumerate(prompts)]
        return {"error": next((result["error"] for result in results if result["error"]), None),
                "tensors": {name: result["conditioning"] for name, result in zip(compared, results, strict=True)
                            if result["conditioning"] is not None},
                "loads": [load for result in results for load in result["loads"]],
                "fix_lines": [line for result in results for line in result["fix_lines"]]}

    def cpu_reference() -> dict:
        with args.servers.start(args.comfyui, models, work, None, pack=True, cache=True) as cpu:
            return {seed_scenarios.VISION_TOWER: conditionings(cpu, pack_workflow, "cpu")["tensors"]}

    def device_runs(pack: bool) -> list[dict]:
        runs, loaders = [], "pack" if pack else "stock"
        with args.servers.start(args.comfyui, models, work, CudaDevice(text_encoder=True), pack, cache=True) as running:
            free = free_mb_of(running[0], 0)
            states = {fix: seed_scenarios.fix_state(running[2], fix) for fix in seed_scenarios.VISION_TOWER_FIXES}
            for budget, resident_mb in seed_scenarios.VISION_TOWER_RESIDENT_MB.items():
                unload_models(running[0])
                reserve = set_budget(running[0], free, budget, resident_mb)
                result = conditionings(running, pack_workflow if pack else stock_workflow, f"{budget}_{loaders}")
                runs.append({"name": seed_scenarios.VISION_TOWER, "group": seed_scenarios.VISION_TOWER,
                             "budget": budget, "pack": pack, "result": result, "compared": compared,
                             "cpu": seed_scenarios.VISION_TOWER, "split_expected": budget in PARTIAL_BUDGETS,
                             "needed": states, "report": {"reserve_vram_gb": reserve, "fix_state": states}})
                print(f"{seed_scenarios.VISION_TOWER} | {budget} | {loaders} | {result['error'] or 'completed'}",
                      flush=True)
        return runs

    cpu, stock_runs, pack_runs = side_by_side(cpu_reference, functools.partial(device_runs, False),
                                              functools.partial(device_runs, True))
    runs = stock_runs + pack_runs
    rows, failed = judge(runs, cpu)
    for row in rows:
        print(f"{row['scenario']} | {row['budget']} | {row['loaders']} | diff {row['max_abs_diff']} against "
              f"{row['judged_against']} | {row['verdict']}", flush=True)
    return rows, failed


def judge_music3_graphs(core: str, state: str | None, runs: dict, compared) -> tuple[list[dict], int]:
    """The rows of one core's Music 3 graph runs (``core``: a core of MUSIC3_GRAPH_CORES, or MUSIC3_GGUF_RUNS) and
    the number of failed checks. ``state``: what the pack's server logged at start-up of music3_graph_buffers on this
    core; ``runs``: {(pack, graphs): run}, a run holding ``result`` (``seed_scenarios.run``'s) and ``loops`` (the
    probe's AR loops). A pack run fails unless it completes, captures graph units with graphs on, and equals stock
    with graphs off within SAME_DEVICE_TOLERANCE; where upstream fixed the bug, the buffers fix must attach nothing;
    with the GGUF encoder the capture policy must leave a unit uncaptured. Stock with graphs on is the red control
    where the bug is there: with the GGUF encoder it must fail with CUDA's capture error (seed 002a), else, where the
    buffers fix is needed, it must differ from graphs off beyond TOLERANCE (the stale replay's noise, seed 002b), or
    the check has shown nothing."""
    gguf = core == MUSIC3_GGUF_RUNS
    graphs_off = runs[False, False]["result"]["tensors"]
    rows, failed = [], 0
    for (pack, graphs), run in sorted(runs.items()):
        result, loops = run["result"], run["loops"]
        vs_graphs_off = per_key(result["tensors"], graphs_off, compared)
        frames, seconds = sum(loop["frames"] for loop in loops), sum(loop["seconds"] for loop in loops)
        units = max((loop["graph_units"] for loop in loops), default=0)
        uncaptured = max((loop["unmarked_units"] for loop in loops), default=0)
        problems = [] if result["error"] is None else [f"error: {result['error'][:120]}"]
        if pack:
            problems += ["no graph unit captured with graphs on"] * (graphs and units == 0)
            problems += ["the capture policy left every unit to capture"] * (gguf and graphs and uncaptured == 0)
            problems += [f"differs from stock with graphs off: {vs_graphs_off}"] * (
                not within(vs_graphs_off, SAME_DEVICE_TOLERANCE))
            problems += ["music3_graph_buffers attached where it is not needed"] * (state != "needed" and any(
                "music3_graph_buffers attached" in line for line in result["fix_lines"]))
            verdict = "pass" if not problems else "FAIL: " + "; ".join(problems)
        elif graphs and gguf:
            problems = [] if CAPTURE_HOST_COPY_ERROR in (result["error"] or "") else [
                f"the capture error did not reproduce: {result['error'] or 'completed'}"]
            verdict = "red control: capture error, as users met it" if not problems else "FAIL: " + "; ".join(problems)
        elif graphs and state == "needed":
            problems += ["the stale replay did not reproduce: equal to graphs off"] * within(vs_graphs_off, TOLERANCE)
            verdict = "red control: noise, as users met it" if not problems else "FAIL: " + "; ".join(problems)
        else:
            verdict = "reported"
        failed += verdict.startswith("FAIL")
        rows.append({"core": core, "loaders": "pack" if pack else "stock (server without the pack)",
                     "graphs": "on" if graphs else "off (--disable-cuda-graphs)", "buffers_fix": state,
                     "error": result["error"], "graph_units": units, "uncaptured_units": uncaptured, "frames": frames,
                     "ms_per_frame": round(1000 * seconds / frames, 3) if frames else None,
                     "vs_stock_graphs_off": vs_graphs_off, "verdict": verdict})
    return rows, failed


def music3_graphs_run(running, workflow: dict, tag: str, graphs: bool, make_prompt, probes) -> dict:
    """One Music 3 prompt on ``running`` (url, object_info, base) with graphs on or off: ``result``
    (``seed_scenarios.run``'s) and ``loops`` (the probe's AR loops). A server that died under it (on CUDA a failed
    capture can abort the process) gives the run the error "the server died", with the capture error where its log
    holds it."""
    from hotfix_testing import seed_scenarios
    from hotfix_testing.comfyui_server import http

    http(running[0] + "/probe/load_args", {"disable_cuda_graphs": not graphs})
    try:
        result = seed_scenarios.run(running, workflow, tag, make_prompt=make_prompt, probes=probes)
        return {"result": result, "loops": json.loads(http(running[0] + "/probe/music3_generate")[1])}
    except OSError:  # the server is gone
        capture_error = CAPTURE_HOST_COPY_ERROR in (running[2] / "comfyui.log").read_text()
        return {"result": {"error": "the server died" + f": {CAPTURE_HOST_COPY_ERROR}" * capture_error,
                           "tensors": {}, "fix_lines": []}, "loops": []}


def music3_graph_runs(args, work: Path, seconds: float = MUSIC3_GRAPH_SECONDS) -> tuple[dict[str, tuple],
                                                                                     tuple[str, ...]]:
    """The Music 3 workflow, ``seconds`` long, through ComfyUI's AR loop on each core of MUSIC3_GRAPH_CORES, and the
    bundled GGUF workflow on MUSIC3_GGUF_CORE ({core or MUSIC3_GGUF_RUNS: (state, runs)}, as ``judge_music3_graphs``
    takes them) and the compared outputs: one server per (core, loaders) under dynamic VRAM with the text encoder on
    the GPU (where ComfyUI graphs its units), each prompt with graphs on, then off, one server at a time (the times are
    the GPU's alone). The GGUF prompts come last on their server, graphs on last of all: on CUDA, stock's failed
    capture can take the server down, as it did the users' (then the log's capture error is the run's error)."""
    from hotfix_testing import seed_scenarios, simulated_cores
    from hotfix_testing.comfyui_server import CudaDevice
    from hotfix_testing.user_workflows import music3_gguf
    from hotfix_testing.workflow_api import load
    from hotfix_testing.workflow_prompts import node_id

    def music3_prompt(workflow: dict, object_info: dict, tag: str) -> dict:
        prompt = scenario.make_prompt(workflow, object_info, tag)
        prompt[node_id(prompt, "MiniMaxMusic3TextEncode")]["inputs"]["max_duration"] = seconds
        return prompt

    models = synthetic_models_in(work)
    scenario = seed_scenarios.named("seed 002 Music 3, dynamic VRAM")
    workflows = dict(zip((True, False), seed_scenarios.workflows(scenario.workflow), strict=True))
    gguf_workflows = {True: load(MUSIC3_GGUF_WORKFLOW), False: music3_gguf()}
    by_core = {}
    for index, core_name in enumerate(MUSIC3_GRAPH_CORES):
        core = simulated_cores.build_core(core_name, work / f"music3_core_{index}" / "ComfyUI")
        runs, gguf_runs = {}, {}
        for pack in (False, True):
            with args.servers.start(core, models, work, CudaDevice(text_encoder=True, dynamic_vram=True),
                                    pack) as running:
                if pack:  # a server without the pack logs nothing of it
                    state = seed_scenarios.fix_state(running[2], "music3_graph_buffers")
                prompts = [(runs, workflows[pack], graphs) for graphs in (True, False)]
                if core_name == MUSIC3_GGUF_CORE:
                    prompts += [(gguf_runs, gguf_workflows[pack], graphs) for graphs in (False, True)]
                for into, workflow, graphs in prompts:
                    tag = f"music3_{index}_{'gguf_' * (into is gguf_runs)}{pack:d}{graphs:d}"
                    into[pack, graphs] = run = music3_graphs_run(running, workflow, tag, graphs, music3_prompt,
                                                                 scenario.probes)
                    print(f"Music 3 graphs | {core_name}{', GGUF' * (into is gguf_runs)} | "
                          f"{'pack' if pack else 'stock'} | graphs {'on' if graphs else 'off'} | "
                          f"{run['result']['error'] or 'completed'} | {run['loops']}", flush=True)
        by_core[core_name] = state, runs
        if gguf_runs:
            by_core[MUSIC3_GGUF_RUNS] = state, gguf_runs
    return by_core, scenario.compared


def music3_graphs_part(args, work: Path) -> tuple[list[dict], int]:
    from hotfix_testing import simulated_cores

    if not simulated_cores.available():
        return [{"verdict": "skipped: the simulated cores need ../shared/comfyui beside the checkout"}], 0
    by_core, compared = music3_graph_runs(args, work)
    rows, failed = [], 0
    for core, (state, runs) in by_core.items():
        core_rows, core_failed = judge_music3_graphs(core, state, runs, compared)
        rows += core_rows
        failed += core_failed
    for row in rows:
        print(" | ".join(str(row[key]) for key in ("core", "loaders", "graphs", "graph_units", "uncaptured_units",
                                                    "ms_per_frame", "verdict")), flush=True)
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


def write_report(path: Path, report: dict) -> None:
    """Writes the report whole or not at all (a cut-off run leaves the last complete one)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2, default=str))
    os.replace(partial, path)


def run_part(run) -> tuple[object, int, float]:
    """``run()``'s result, its failed checks and its wall seconds; a part that raises is one failed check with its
    error, so that the device call still answers for the other parts."""
    started = time.monotonic()
    try:
        result, failed = run()
    except Exception as exc:
        traceback.print_exc()
        result, failed = {"crashed": f"{type(exc).__name__}: {exc}"}, 1
    return result, failed, round(time.monotonic() - started, 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = cannot_run(args)
    if reason:
        print(reason)
        return CANNOT_RUN
    started = time.monotonic()
    report = {"torch": torch.__version__, "cuda": torch.version.cuda, "comfyui": str(args.comfyui.resolve()),
              "devices": [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())],
              "tolerance": TOLERANCE, "same_device_tolerance": SAME_DEVICE_TOLERANCE, "parts": args.parts,
              "failed_checks": 0}

    def record(part: str, outcome: tuple) -> None:
        report[part], part_failed, report[f"{part}_wall_s"] = outcome
        report["failed_checks"] += part_failed
        report["wall_s"] = round(time.monotonic() - started, 1)
        write_report(args.out, report)
        print(f"== part {part}: {part_failed} failed, {report[f'{part}_wall_s']} s; report: {args.out}", flush=True)

    with tempfile.TemporaryDirectory(prefix="minimax-hotfix-gpu-check-") as work:
        work = Path(work)
        parts = {"scenarios": lambda: scenario_part(args, work),
                 "h3_divergence": lambda: h3_divergence_part(args, work),
                 "vision_tower": lambda: vision_tower_part(args, work),
                 "music3_graph_capture": lambda: benchmark_part("music3_graph_capture", work),
                 "music3_graphs_comfyui": lambda: music3_graphs_part(args, work),
                 "h3_fp16_overflow": lambda: benchmark_part("h3_fp16_overflow", work),
                 "doctor": lambda: doctor_part(args.comfyui)}
        if SYNTHETIC_MODEL_PARTS & set(args.parts):
            synthetic_models_in(work)
        untimed = [part for part in args.parts if part not in TIMED_PARTS]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(untimed))) as pool:
            running = {pool.submit(run_part, parts[part]): part for part in untimed}
            for done in concurrent.futures.as_completed(running):
                record(running[done], done.result())
        for part in (part for part in args.parts if part in TIMED_PARTS):
            record(part, run_part(parts[part]))
    failed = report["failed_checks"]
    print(f"{'all checks passed' if not failed else f'{failed} check(s) failed'} in {report['wall_s']} s; "
          f"report: {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
