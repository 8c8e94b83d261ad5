"""The opt-in GPU check (benchmarks/gpu_check.py) stays runnable without a GPU: it refuses in one line, and it runs
the very scenario list of the simulated-device tests (tests/hotfix_testing/seed_scenarios.py), budget by budget, stock and pack."""

import ast
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
                       for budget in s.resident_mb for pack in (False, True)}


def test_one_cuda_device_skips_only_the_multi_device_and_the_no_int_mm_scenarios(gpu_check):
    skipped = {run["scenario"].name for run in gpu_check.plan(device_count=1) if run["skipped"]}
    assert skipped == {s.name for s in seed_scenarios.SCENARIOS if s.devices_needed > 1 or not s.int_mm} != set()


@pytest.mark.parametrize("free_mb, resident_mb", [(80_000, 0), (80_000, 1.5), (24_000, 512)])
def test_the_reserve_leaves_the_resident_mb(gpu_check, free_mb, resident_mb):
    reserve_mb = gpu_check.reserve_vram_gb(free_mb, resident_mb) * 1024
    assert free_mb - (gpu_check.INFERENCE_MB + reserve_mb) == pytest.approx(resident_mb)


@pytest.fixture
def simulated_cuda(gpu_check, comfyui, monkeypatch):
    """Two simulated devices standing in for CUDA: each server the GPU check would start with a ``--reserve-vram``
    (and ``--default-device``) is a simulated-device server whose total leaves the same resident MB (models on that
    device), with ComfyUI's free memory read as FREE_MB."""
    import dataclasses

    from hotfix_testing import comfyui_server, simulated_cores

    if not simulated_cores.available():
        pytest.skip("needs ../shared/comfyui (the simulated device's servers run on its trees)")

    @dataclasses.dataclass(frozen=True)
    class SimulatedCuda(comfyui_server.SimulatedDevice):
        reserve_vram_gb: float | None = None

    def cuda_device(reserve_vram_gb=None, index=0, text_encoder=False, dynamic_vram=False):
        resident_mb = FREE_MB - gpu_check.INFERENCE_MB - (reserve_vram_gb or 0) * 1024
        return SimulatedCuda(total_mb=seed_scenarios.RESERVE_MB + resident_mb, current=index,
                             force_fp32=not text_encoder, reserve_vram_gb=reserve_vram_gb, dynamic_vram=dynamic_vram)

    monkeypatch.setattr(comfyui_server, "CudaDevice", cuda_device)
    monkeypatch.setattr(gpu_check, "free_mb_on", lambda *args: FREE_MB)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


FREE_MB = 2048.0


@pytest.fixture
def one_budget_each(monkeypatch):
    """Every scenario at its "partial" budget only (where it has one), seed 001 at "partial" on one canvas, and the
    models on device 0 only (the split over two devices keeps device 1 in the run): the dry runs check the GPU check's
    own code, which is the same at every budget and device, and each budget and device is a server start (the
    simulated-device tests run all of them)."""
    import dataclasses

    def partial_only(budgets: dict) -> dict:
        return {"partial": budgets["partial"]} if "partial" in budgets else budgets

    monkeypatch.setattr(seed_scenarios, "SCENARIOS", tuple(
        dataclasses.replace(scenario, resident_mb=partial_only(scenario.resident_mb))
        for scenario in seed_scenarios.SCENARIOS if scenario.device_index == 0))
    monkeypatch.setattr(seed_scenarios, "VISION_TOWER_RESIDENT_MB",
                        partial_only(seed_scenarios.VISION_TOWER_RESIDENT_MB))
    first_canvas = next(iter(seed_scenarios.VISION_TOWER_CANVASES.items()))
    monkeypatch.setattr(seed_scenarios, "VISION_TOWER_CANVASES", dict([first_canvas]))


def test_its_scenario_part_runs_with_the_simulated_device_standing_in_for_cuda(gpu_check, simulated_cuda,
                                                                              one_budget_each, tmp_path):
    """The scenario part run once without a GPU, on the simulated 0.36/0.37 VAE core: every pack run passes (red,
    found by this run: Music 3, which ComfyUI never splits, failed the split check at the partial budgets), the stock
    runs are reported, seed 004 is skipped (CUDA has ``_int_mm``)."""
    import argparse

    from hotfix_testing import simulated_cores

    core = simulated_cores.build_core("0.36/0.37 VAE", tmp_path / "core" / "ComfyUI")
    rows, failed = gpu_check.scenario_part(argparse.Namespace(comfyui=core), tmp_path)
    verdicts = {row["verdict"].split(":")[0] for row in rows if row["loaders"] == "pack"}
    assert failed == 0 and verdicts == {"pass", "skipped"}, [row for row in rows if row["verdict"] == "FAIL"]
    assert {row["scenario"] for row in rows if row["verdict"].startswith("skipped")} == {
        s.name for s in seed_scenarios.SCENARIOS if not s.int_mm}
    assert all(row["verdict"] == "reported" for row in rows if row["loaders"] != "pack"
               and not row["verdict"].startswith("skipped"))


def test_its_vision_tower_part_runs_with_the_simulated_device_standing_in_for_cuda(gpu_check, simulated_cuda,
                                                                                    one_budget_each, comfyui, tmp_path):
    """The seed 001 part (``vision_tower_part``) run once without a GPU (ComfyUI 0.33.0 here), so its own code
    (prompts, references, comparison, split and hook checks, verdicts) has run before a GPU is at hand."""
    import argparse

    rows, failed = gpu_check.vision_tower_part(argparse.Namespace(comfyui=Path(comfyui)), tmp_path)
    verdicts = {(row["budget"], row["loaders"]): row["verdict"] for row in rows}
    assert failed == 0 and verdicts == {(budget, loaders): "pass" if loaders == "pack" else "reported"
                                        for budget in seed_scenarios.VISION_TOWER_RESIDENT_MB
                                        for loaders in ("stock (server without the pack)", "pack")}, rows
    assert all(row["max_abs_diff"] <= 1e-4 for row in rows) and all(row["partial_load"] for row in rows
                                                                    if row["budget"] != "full"), rows
