"""The opt-in GPU check (benchmarks/gpu_check.py) stays runnable without a GPU: it refuses in one line, and it runs
the very scenario list of the simulated-device tests (tests/hotfix_testing/seed_scenarios.py), budget by budget, stock and pack."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hotfix_testing import seed_scenarios

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SIMULATED_DEVICE_TESTS = (ROOT / "tests" / "test_seed_scenarios_on_device.py",
                          ROOT / "tests" / "test_dynamic_vram_on_device.py")


@pytest.fixture(scope="module")
def gpu_check():
    from minimax_hotfix.benchmarks import gpu_check  # benchmarks/, reached through the pack's folder

    return gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check itself runs there")
def test_without_cuda_it_refuses_in_one_line_with_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--comfyui", str(tmp_path), "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stdout.strip().splitlines()) == 1 and "needs CUDA" in done.stdout, done.stdout
    assert not done.stderr and not (tmp_path / "r.json").exists(), done.stderr


def scenarios_of_the_simulated_device_tests() -> dict[str, str]:
    """test function -> the scenario it runs (its ``scenario = named("...")``)."""
    found = {}
    for function in (node for path in SIMULATED_DEVICE_TESTS for node in ast.parse(path.read_text("utf-8")).body):
        if isinstance(function, ast.FunctionDef) and function.name.startswith("test_"):
            for node in ast.walk(function):
                if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["scenario"]
                        and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "named"):
                    found[function.name] = node.value.args[0].value
    return found


def test_its_scenario_list_is_the_simulated_device_tests_list(gpu_check):
    assert scenarios_of_the_simulated_device_tests() == {s.test: s.name for s in seed_scenarios.SCENARIOS}
    planned = {(run["scenario"].name, run["budget"], run["pack"]) for run in gpu_check.plan(device_count=2)
               if not run["skipped"]}
    assert planned == {(s.name, budget, pack) for s in seed_scenarios.SCENARIOS if s.int_mm
                       for budget in s.resident_mb for pack in (False, True)} | {
        (s.name, "full", False) for s in seed_scenarios.SCENARIOS if s.int_mm and "full" not in s.resident_mb}


def test_one_cuda_device_skips_only_the_multi_device_and_the_no_int_mm_scenarios(gpu_check):
    skipped = {run["scenario"].name for run in gpu_check.plan(device_count=1) if run["skipped"]}
    assert skipped == {s.name for s in seed_scenarios.SCENARIOS if s.devices_needed > 1 or not s.int_mm} != set()


@pytest.mark.parametrize("free_mb, resident_mb", [(80_000, 0), (80_000, 1.5), (24_000, 512)])
def test_the_reserve_leaves_the_resident_mb(gpu_check, free_mb, resident_mb):
    reserve_mb = gpu_check.reserve_vram_gb(free_mb, resident_mb) * 1024
    assert free_mb - (gpu_check.INFERENCE_MB + reserve_mb) == pytest.approx(resident_mb)


@pytest.fixture
def simulated_cuda(gpu_check, comfyui, monkeypatch, tmp_path_factory):
    """Two simulated devices standing in for CUDA (``gpu_check_dry_run.stand_in_for_cuda``): the GPU check's servers
    start on them as the recipe for a bare CUDA machine says (docs/testing.md) and set each budget's
    ``--reserve-vram`` through the probe node, as on a GPU."""
    from hotfix_testing import simulated_cores
    from hotfix_testing.gpu_check_dry_run import stand_in_for_cuda

    if not simulated_cores.available():
        pytest.skip("needs ../shared/comfyui (the simulated device's servers run on its trees)")
    stand_in_for_cuda(monkeypatch, gpu_check, tmp_path_factory.mktemp("without_frontend"))


def check_args(gpu_check, comfyui: Path):
    """The check's options for a part run on its own: the ComfyUI at ``comfyui``, two servers at once (this machine's
    cores)."""
    return gpu_check.parse_args(["--comfyui", str(comfyui), "--servers", "2"])


@pytest.fixture
def two_budgets_each(monkeypatch):
    """Every scenario at its "full" and "partial" budgets only (where it has them: "full" gives a group its fault-free
    run on the device), seed 001 on one canvas, and the models on device 0 only (the split over two devices keeps
    device 1 in the run): the dry runs check the GPU check's own code, which is the same at every budget and device
    (the simulated-device tests run all of them)."""
    import dataclasses

    def full_and_partial(budgets: dict) -> dict:
        kept = {name: mb for name, mb in budgets.items() if name in ("full", "partial")}
        return kept or budgets

    monkeypatch.setattr(seed_scenarios, "SCENARIOS", tuple(
        dataclasses.replace(scenario, resident_mb=full_and_partial(scenario.resident_mb))
        for scenario in seed_scenarios.SCENARIOS if scenario.device_index == 0))
    monkeypatch.setattr(seed_scenarios, "VISION_TOWER_RESIDENT_MB",
                        full_and_partial(seed_scenarios.VISION_TOWER_RESIDENT_MB))
    first_canvas = next(iter(seed_scenarios.VISION_TOWER_CANVASES.items()))
    monkeypatch.setattr(seed_scenarios, "VISION_TOWER_CANVASES", dict([first_canvas]))


H200_OFFSET = 0.37631547451019287  # what every H3 run on the H200 differed from the CPU by, stock and pack alike


def shifted(runs: list[dict], offset: float, which) -> list[dict]:
    """``runs`` with ``offset`` added to every output of the runs ``which`` selects."""
    return [{**run, "result": {**run["result"], "tensors": {name: value + offset for name, value
                                                            in run["result"]["tensors"].items()}}}
            if which(run) else run for run in runs]


def cpu_only_failures(gpu_check, runs: list[dict], cpu: dict) -> int:
    """The old verdict: the pack's runs against the CPU, every key within TOLERANCE."""
    return sum(not gpu_check.within(gpu_check.per_key(run["result"]["tensors"], cpu[run["cpu"]], run["compared"]),
                                    gpu_check.TOLERANCE) for run in runs if run["pack"])


H3_FIXED_AUDIO_LATENT = (1, 32, 2, 8)  # the audio part of seed 000's latent: the probe's fixed latent has its shape


def rounding_spread(state: dict) -> float:
    """How far rounding alone moves a synthetic H3 audio VAE's decode of the probe's fixed latent
    (``TestProbeFixedLatent``): max abs diff between its fp32 and its fp64 decode."""
    import comfy.sd

    from hotfix_testing import synthetic_models

    patchers = synthetic_models.tiny_config_patches()
    for patcher in patchers:
        patcher.start()
    try:
        model = comfy.sd.VAE(sd=dict(state)).first_stage_model
    finally:
        for patcher in patchers:
            patcher.stop()
    latent = torch.randn(H3_FIXED_AUDIO_LATENT, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        single = model.float().decode(latent).double()
        double = model.double().decode(latent.double())
    return (single - double).abs().max().item()


def test_the_synthetic_h3_audio_vae_decodes_above_rounding_where_random_filters_left_it_at_the_clamp(gpu_check,
                                                                                                     comfyui):
    """The first GPU run's 0.376, the same to the last digit in every completed H3 run, points at the fixed-latent
    audio: the one compared output that depends on nothing the budgets, loaders or pack change. The synthetic audio
    VAE had random anti-aliasing filters and full-size residual branches; its output sat at the clamp, each sample the
    sign of a sum of terms up to 5.4e5, so fp32 rounding alone flipped samples, and a GPU sums in another order than the CPU. Red: that
    writer's state, fp32 against fp64, 1.0 or more apart. Green: the writer's state now, within a hundredth of the
    check's TOLERANCE."""
    from hotfix_testing import synthetic_models

    state = synthetic_models.h3_audio_vae(torch.Generator().manual_seed(synthetic_models.SEED))
    generator = torch.Generator().manual_seed(synthetic_models.SEED)
    random_filters = {key: synthetic_models.random_like(value.shape, value.dtype, generator)
                      if key.endswith(".filter") else value for key, value in state.items()}
    full_branches = {key: value / synthetic_models.AUDIO_RESIDUAL_BRANCH_SCALE
                     if ".convs2." in key and key.endswith(".weight") else value
                     for key, value in random_filters.items()}
    assert rounding_spread(full_branches) >= 1.0
    assert rounding_spread(state) <= gpu_check.TOLERANCE / 100


def test_its_scenario_part_judges_on_the_device_with_the_simulated_device_standing_in_for_cuda(
        gpu_check, simulated_cuda, two_budgets_each, tmp_path):
    """The scenario part run once without a GPU, on the simulated 0.36/0.37 VAE core, one server per loaders and
    memory manager with the budgets set through the probe: every pack run passes, "full" loads everything (stock's
    VAE decode completes there: the group's fault-free run), the partial budgets split, seed 004 is skipped (CUDA
    has ``_int_mm``); the same-device diffs are 0 (SAME_DEVICE_TOLERANCE's footing). Red controls on these runs: a
    device that differs from the CPU by the H200's 0.376 everywhere fails the old CPU-only verdict and passes the
    new one; a pack whose output is off by 5e-4 on the device passes the old one there and fails the new one."""
    from hotfix_testing import simulated_cores

    core = simulated_cores.build_core("0.36/0.37 VAE", tmp_path / "core" / "ComfyUI")
    runs, cpu, skipped = gpu_check.scenario_runs(check_args(gpu_check, core), tmp_path)
    rows, failed = gpu_check.judge(runs, cpu)
    assert failed == 0 and {row["verdict"] for row in rows if row["loaders"] == "pack"} == {"pass"}, \
        [row for row in rows if row["verdict"].startswith("FAIL")]
    assert {row["scenario"] for row in skipped} == {s.name for s in seed_scenarios.SCENARIOS if not s.int_mm}
    seed_000 = {(row["budget"], row["loaders"]): row for row in rows if row["scenario"] == "seed 000 H3 t2v"}
    full_stock = seed_000["full", "stock (server without the pack)"]
    assert full_stock["error"] is None and not full_stock["partial_load"], full_stock
    assert seed_000["partial", "stock (server without the pack)"]["error"], "the bug shows at the partial budget"
    assert all(row["judged_against"] == "fault-free run on this device" and row["max_abs_diff"] == 0
               for row in rows if row["loaders"] == "pack" and row["scenario"].startswith("seed 000")), rows
    assert any(diff for row in rows if row["vs_cpu"] for diff in row["vs_cpu"].values()), "the device is not the CPU"

    on_the_h200 = shifted(runs, H200_OFFSET, lambda run: True)
    assert cpu_only_failures(gpu_check, runs, cpu) == 0 and cpu_only_failures(gpu_check, on_the_h200, cpu) > 0
    assert gpu_check.judge(on_the_h200, cpu)[1] == 0

    broken = shifted(runs, 5e-4, lambda run: run["pack"] and run["name"] == "seed 000 H3 t2v")
    assert cpu_only_failures(gpu_check, broken, cpu) == 0, "the old verdict lets 5e-4 through"
    rows, failed = gpu_check.judge(broken, cpu)
    assert failed == 2 and all("differs from the fault-free run on this device" in row["verdict"] for row in rows
                               if row["loaders"] == "pack" and row["scenario"] == "seed 000 H3 t2v"), rows


def test_its_h3_divergence_part_traces_every_module_call_and_names_the_first_that_parts(gpu_check, simulated_cuda,
                                                                                        monkeypatch, tmp_path):
    """The H3 divergence part run once without a GPU, on the simulated 0.36/0.37 VAE core: the device run and the
    ``--cpu`` run make the same module calls, and with the device's matmuls and convolutions off in the last bit no
    call's output parts beyond DIVERGENCE. Red controls on the two traces: one call's output changed (the first
    audio VAE call, as a GPU kernel that computed otherwise), a call missing, a run cut short: each is named."""
    from hotfix_testing import simulated_cores

    core = simulated_cores.build_core("0.36/0.37 VAE", tmp_path / "core" / "ComfyUI")
    traces, traced_run = {}, gpu_check.traced_run  # by tag: the CPU run is in a thread beside the device's
    monkeypatch.setattr(gpu_check, "traced_run", lambda running, workflow, scenario, tag: traces.setdefault(
        tag, traced_run(running, workflow, scenario, tag)))
    report, failed = gpu_check.h3_divergence_part(check_args(gpu_check, core), tmp_path)
    assert failed == 0 and report["errors"] == {"cpu": None, "device": None}, report
    assert report["first_divergence"] is None and report["calls"]["cpu"] == report["calls"]["device"] > 1000, report
    assert all(diff <= gpu_check.TOLERANCE for diff in report["vs_cpu"].values()), report

    (_, cpu), (_, device) = traces["divergence_cpu"], traces["divergence_device"]
    audio = next(index for index, call in enumerate(device) if ".audio_vae." in call[0])
    changed = [*device[:audio], [*device[audio][:2], device[audio][2] * 1.01, device[audio][3]], *device[audio + 1:]]
    assert gpu_check.first_divergence(cpu, changed) == {
        "call": audio, "why": "its output differs", "cpu": cpu[audio], "device": changed[audio],
        "before": cpu[audio - 3:audio]}
    gone = next(index for index in range(audio, len(device)) if device[index][:2] != device[index + 1][:2])
    assert gpu_check.first_divergence(cpu, device[:gone] + device[gone + 1:])["why"] == "another module or shape"
    assert gpu_check.first_divergence(cpu, device[:-1]) == {
        "call": len(device) - 1, "why": f"{len(cpu)} calls on the CPU, {len(device) - 1} on the device"}


def test_its_vision_tower_part_runs_with_the_simulated_device_standing_in_for_cuda(gpu_check, simulated_cuda,
                                                                                    two_budgets_each, comfyui,
                                                                                    tmp_path):
    """The seed 001 part (``vision_tower_part``) run once without a GPU (ComfyUI 0.33.0 here), so its own code
    (prompts, budgets through the probe, references, judging) has run before a GPU is at hand."""
    rows, failed = gpu_check.vision_tower_part(check_args(gpu_check, Path(comfyui)), tmp_path)
    verdicts = {(row["budget"], row["loaders"]): row["verdict"].split(";")[0] for row in rows}
    assert failed == 0 and verdicts == {(budget, loaders): "pass" if loaders == "pack" else "reported"
                                        for budget in seed_scenarios.VISION_TOWER_RESIDENT_MB
                                        for loaders in ("stock (server without the pack)", "pack")}, rows
    assert all(row["judged_against"] == "fault-free run on this device" and row["max_abs_diff"] == 0
               for row in rows), rows
    assert all(row["partial_load"] is (row["budget"] != "full") for row in rows), rows


def test_its_music3_graph_part_shows_the_stale_replay_and_the_fix_through_comfyui(gpu_check, comfyui, monkeypatch,
                                                                                  tmp_path):
    """The Music 3 graph part (``music3_graph_runs``) run once without a GPU: servers on the simulated device with
    dynamic VRAM, the text encoder on the device and the AR loop on the emulated CUDA graphs under the emulated
    capture rules (hotfix_testing/emulated_graphs.py), the units those ComfyUI's load marked. On the post-#15861 core
    stock with graphs is noise and the pack equals graphs off with its units captured; on the fixed core the pack
    attaches no buffers and equals stock. The bundled GGUF workflow (seed 002a: its Q4_0 layer through the stand-in
    of ComfyUI-GGUF's Dynamic VRAM loader): stock with graphs fails with CUDA's capture error, the pack leaves that
    one unit uncaptured, graphs the others and equals graphs off. Red controls of the verdict: a pack whose graphed
    output is off by 5e-4, a stock core that does not show the noise, a stock GGUF run that completes, and a pack
    whose policy left every unit to capture, all fail."""
    from hotfix_testing import simulated_cores
    from hotfix_testing.gpu_check_dry_run import stand_in_for_cuda
    from hotfix_testing.workflow_prompts import MUSIC3_SECONDS

    if not simulated_cores.available():
        pytest.skip("needs ../shared/comfyui (the simulated cores)")
    stand_in_for_cuda(monkeypatch, gpu_check, tmp_path / "without_frontend", emulated_graphs=True)
    by_core, compared = gpu_check.music3_graph_runs(check_args(gpu_check, Path(comfyui)), tmp_path,
                                                    seconds=MUSIC3_SECONDS)  # 5 frames, not the GPU's 250
    stale, fixed = gpu_check.MUSIC3_GRAPH_CORES
    gguf = gpu_check.MUSIC3_GGUF_RUNS
    judged = {core: gpu_check.judge_music3_graphs(core, state, runs, compared)
              for core, (state, runs) in by_core.items()}
    rows = {(row["core"], row["loaders"].split()[0], row["graphs"].split()[0]): row
            for core_rows, _ in judged.values() for row in core_rows}
    assert all(failed == 0 for _, failed in judged.values()), rows
    assert rows[stale, "stock", "on"]["verdict"].startswith("red control")
    assert rows[stale, "pack", "on"]["buffers_fix"] == "needed"
    assert max(rows[stale, "stock", "on"]["vs_stock_graphs_off"].values()) > 1.0, rows[stale, "stock", "on"]
    assert rows[fixed, "pack", "on"]["buffers_fix"] == "fixed upstream"
    assert rows[gguf, "stock", "on"]["verdict"] == "red control: capture error, as users met it"
    assert gpu_check.CAPTURE_HOST_COPY_ERROR in rows[gguf, "stock", "on"]["error"]
    # the load marks all 3 units (2 Llama layers, the depth decoder); the policy keeps the Q4_0 layer's from capture
    assert [rows[core, "pack", "on"]["graph_units"] for core in (fixed, gguf)] == [3, 2]
    assert [rows[gguf, loaders, "on"]["uncaptured_units"] for loaders in ("stock", "pack")] == [0, 1]
    for (core, loaders, graphs), row in rows.items():
        if (core, loaders, graphs) != (gguf, "stock", "on"):
            assert row["error"] is None and (row["graph_units"] > 0) is (graphs == "on"), row
        if loaders == "pack" or core == fixed:
            assert set(row["vs_stock_graphs_off"].values()) == {0.0}, row

    state, runs = by_core[stale]
    off_by = {**runs, (True, True): {**runs[True, True], "result": {**runs[True, True]["result"], "tensors": {
        name: value + 5e-4 for name, value in runs[True, True]["result"]["tensors"].items()}}}}
    assert gpu_check.judge_music3_graphs(stale, state, off_by, compared)[1] == 1
    no_noise = {**runs, (False, True): runs[False, False]}
    assert gpu_check.judge_music3_graphs(stale, state, no_noise, compared)[1] == 1
    state, runs = by_core[gguf]
    no_capture_error = {**runs, (False, True): runs[False, False]}
    assert gpu_check.judge_music3_graphs(gguf, state, no_capture_error, compared)[1] == 1
    every_unit_captured = {**runs, (True, True): {**runs[True, True], "loops": [
        {**loop, "unmarked_units": 0} for loop in runs[True, True]["loops"]]}}
    assert gpu_check.judge_music3_graphs(gguf, state, every_unit_captured, compared)[1] == 1


def test_a_server_killed_by_its_failed_capture_is_the_runs_error(gpu_check, monkeypatch, tmp_path):
    """On CUDA a failed capture can abort the server, as it did the users' (seed 002a): the run then reads "the server
    died" with the capture error from the log, the red control's verdict holds, and the other runs still report.
    Red control: a run that raises OSError (the server gone) without that handling ends the whole part."""
    import urllib.error

    from hotfix_testing import comfyui_server

    (tmp_path / "comfyui.log").write_text(f"RuntimeError: {gpu_check.CAPTURE_HOST_COPY_ERROR}\n"
                                          "Fatal Python error: Aborted\n")
    monkeypatch.setattr(comfyui_server, "http", lambda url, body=None: (200, b"{}"))

    def died(*args, **kwargs):
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    monkeypatch.setattr(seed_scenarios, "run", died)
    run = gpu_check.music3_graphs_run(("http://127.0.0.1:1", {}, tmp_path), {}, "gguf_01", True, None, ())
    assert run == {"result": {"error": f"the server died: {gpu_check.CAPTURE_HOST_COPY_ERROR}", "tensors": {},
                              "fix_lines": []}, "loops": []}
    completed = {"result": {"error": None, "tensors": {}, "fix_lines": []},
                 "loops": [{"seconds": 1.0, "frames": 5, "graph_units": 0, "unmarked_units": 0}]}
    rows, failed = gpu_check.judge_music3_graphs(gpu_check.MUSIC3_GGUF_RUNS, "fixed upstream", {
        (False, False): completed, (False, True): run}, ())
    assert failed == 0 and rows[1]["verdict"] == "red control: capture error, as users met it", rows
    (tmp_path / "comfyui.log").write_text("Fatal Python error: Segmentation fault\n")  # died of something else
    other = gpu_check.music3_graphs_run(("http://127.0.0.1:1", {}, tmp_path), {}, "gguf_01", True, None, ())
    assert gpu_check.judge_music3_graphs(gpu_check.MUSIC3_GGUF_RUNS, "fixed upstream", {
        (False, False): completed, (False, True): other}, ())[1] == 1


def test_the_report_is_written_after_each_part(gpu_check, monkeypatch, tmp_path):
    """A run cut off in its second part leaves the first part's report, whole."""
    out = tmp_path / "report.json"
    monkeypatch.setattr(gpu_check, "cannot_run", lambda args: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(gpu_check, "doctor_part", lambda comfyui: ({"exit_code": 0}, 0))

    def cut_off(name, work):
        raise KeyboardInterrupt("the device call's limit")

    monkeypatch.setattr(gpu_check, "benchmark_part", cut_off)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--comfyui", str(tmp_path), "--out", str(out), "--parts", "doctor,h3_fp16_overflow"])
    report = json.loads(out.read_text())
    assert report["doctor"] == {"exit_code": 0} and "h3_fp16_overflow" not in report
    assert report["parts"] == ["doctor", "h3_fp16_overflow"] and not list(tmp_path.glob("*.partial"))


def test_the_judging_parts_run_side_by_side_and_the_timed_ones_after_them_alone(gpu_check, monkeypatch, tmp_path):
    """Every part stood in for by one that records when it ran: the parts that judge meet at a barrier, which only
    parts running side by side can pass (one after another, each would wait there in vain); the timed parts start
    after every other part has ended and never overlap; a part that raises is one failed check, with its error in
    the report, and the others still report."""
    import threading
    import time

    out, spans = tmp_path / "report.json", {}
    untimed = [part for part in gpu_check.PARTS if part not in gpu_check.TIMED_PARTS]
    met = threading.Barrier(len(untimed), timeout=10)

    def part(name: str, crash: bool = False):
        started = time.monotonic()
        if name in untimed:
            met.wait()
        time.sleep(0.05)
        spans[name] = started, time.monotonic()
        if crash:
            raise RuntimeError(f"{name} broke")
        return {"ran": name}, 0

    monkeypatch.setattr(gpu_check, "cannot_run", lambda args: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(gpu_check, "synthetic_models_in", lambda work: None)
    monkeypatch.setattr(gpu_check, "scenario_part", lambda args, work: part("scenarios"))
    monkeypatch.setattr(gpu_check, "h3_divergence_part", lambda args, work: part("h3_divergence", crash=True))
    monkeypatch.setattr(gpu_check, "vision_tower_part", lambda args, work: part("vision_tower"))
    monkeypatch.setattr(gpu_check, "music3_graphs_part", lambda args, work: part("music3_graphs_comfyui"))
    monkeypatch.setattr(gpu_check, "benchmark_part", lambda name, work: part(name))
    monkeypatch.setattr(gpu_check, "doctor_part", lambda comfyui: part("doctor"))
    assert gpu_check.main(["--comfyui", str(tmp_path), "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["failed_checks"] == 1 and report["h3_divergence"] == {"crashed": "RuntimeError: h3_divergence broke"}
    assert all(report[name] == {"ran": name} for name in gpu_check.PARTS if name != "h3_divergence"), report
    timed = sorted(spans[name] for name in gpu_check.TIMED_PARTS)
    assert timed[0][0] >= max(spans[name][1] for name in untimed), spans
    assert all(earlier[1] <= later[0] for earlier, later in zip(timed, timed[1:], strict=False)), spans


def test_every_cuda_server_of_the_check_pins_its_free_memory_reading():
    """``CudaDevice`` asks for the pinned reading and ``pin_where_asked`` (the probe's call) puts it in place of
    ``torch.cuda.mem_get_info``; without the variable (a server outside the check) the device's reading stays."""
    import types

    from hotfix_testing.comfyui_server import CudaDevice
    from hotfix_testing.pinned_free_memory import PINNED_FREE_MEMORY_ENV, pin_where_asked

    def fake_cuda():
        device = {"free": 1000}
        return device, types.SimpleNamespace(
            mem_get_info=lambda index=None: (device["free"], 2000), memory_reserved=lambda index: 0,
            _utils=types.SimpleNamespace(_get_device_index=lambda device, optional: 0))

    assert CudaDevice(dynamic_vram=True).environment()[PINNED_FREE_MEMORY_ENV] == "1"
    for environment, pinned in ((CudaDevice().environment(), True), ({}, False)):
        device, cuda = fake_cuda()
        assert pin_where_asked(cuda, environment) is pinned and cuda.mem_get_info() == (1000, 2000)
        device["free"] -= 300  # a neighbour loads
        assert cuda.mem_get_info(0) == ((1000 if pinned else 700), 2000)


def test_a_server_reads_its_free_memory_as_if_alone_on_the_gpu():
    """``pinned_free_memory.pinned`` over a GPU that another process loads: the device's own reading falls by the
    neighbour's bytes (what would shrink this server's partial loads), the pinned one only by this process's."""
    from hotfix_testing.pinned_free_memory import pinned

    mib, device = 2**20, {"free": 8000 * 2**20, "total": 8192 * 2**20}
    ours = {0: 100 * mib}

    def mem_get_info(index):
        return device["free"], device["total"]

    reading = pinned(mem_get_info, lambda index: ours[index], lambda device: 0 if device is None else device)
    assert reading() == (8000 * mib, 8192 * mib)
    device["free"] -= 500 * mib  # the neighbour loads
    assert mem_get_info(0)[0] == 7500 * mib and reading(0) == (8000 * mib, 8192 * mib)
    ours[0] += 64 * mib  # this server loads
    device["free"] -= 64 * mib
    assert reading(0) == (7936 * mib, 8192 * mib)


def test_unknown_parts_are_refused(gpu_check, capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--comfyui", ".", "--parts", "scenarios,vision"])
    assert "unknown vision" in capsys.readouterr().err


def test_no_server_slots_are_refused(gpu_check, capsys):
    """``--servers 0`` would leave every server waiting for a slot for ever: refused at once."""
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--comfyui", ".", "--servers", "0"])
    assert "--servers: at least 1" in capsys.readouterr().err
