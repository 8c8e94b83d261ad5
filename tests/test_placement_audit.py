"""The placement audit (diagnostics/placement_audit.py) on the core under test (0.33.0 in CI's ComfyUI run) and, in
subprocesses, on the simulated cores that change the audited models' code. Real classes at their real
configuration on FakeTensor weights, loaded by ComfyUI's real ModelPatcher; pack on must leave nothing."""

import json
import resource
import time

import pytest

from minimax_hotfix.benchmarks._linear_input_act import use_newer_linear_input_act
from minimax_hotfix.diagnostics import placement_audit
from simulated_cores import running_on_simulated_core

BUDGETS = ("none", "50%", "full", "dynamic")
# the slowest model on FakeTensors (~7,000 ops per call): its partial load once, the doctor's run has all budgets
BUDGETS_BY_MODEL = {"H3 audio VAE": ("none",)}
ALL_MODELS = {"H3 DiT", "H3 video VAE decoder", "H3 video VAE encoder", "H3 audio VAE",
              "H3 text encoder: Qwen3-VL vision tower", "H3 text encoder: language model",
              "Music 3 text encoder (AR)", "Music 3 DiT", "Music 3 DAV"}
# what the audit must find with the pack off, per core (a red control for the audit itself)
EXPECTED_OFF = {
    None: {("H3 text encoder: Qwen3-VL vision tower", "none"): "host build", ("Music 3 DAV", "50%"): "cross-device",
           ("H3 video VAE encoder", "none"): "host-to-device",
           ("H3 text encoder: Qwen3-VL vision tower", "dynamic"): "host build"},
    "0.38 Qwen3-VL": {("H3 text encoder: Qwen3-VL vision tower", "none"): "host build",
                      ("H3 text encoder: Qwen3-VL vision tower", "dynamic"): "host build"},
    "0.36/0.37 VAE": {("H3 video VAE decoder", "none"): "cross-device", ("H3 video VAE decoder", "50%"): "cross-device"},
}


@pytest.fixture(scope="module")
def audited(comfyui):
    patch = pytest.MonkeyPatch()
    use_newer_linear_input_act(patch.setattr)  # the newer VAE's call form, where this core lacks it
    start = time.perf_counter()
    rows = placement_audit.audit(BUDGETS, BUDGETS_BY_MODEL)
    seconds = time.perf_counter() - start
    patch.undo()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nplacement audit on {running_on_simulated_core() or 'this core'}: {seconds:.1f} s, peak RSS "
          f"{peak_mb:.0f} MB\n{placement_audit.table(rows)}")
    return rows


def test_every_model_is_audited_or_says_why(audited):
    assert {row.model for row in audited} >= ALL_MODELS
    assert all(row.not_audited or row.budget in BUDGETS_BY_MODEL.get(row.model, BUDGETS) for row in audited)


def test_pack_on_leaves_no_cross_device_op_and_no_host_work(audited):
    on = [row for row in audited if row.pack == "on" and not row.not_audited]
    assert on
    left = [(row.model, row.budget, f) for row in on for f in row.findings if not f.accepted]
    assert left == []


def test_pack_off_finds_the_known_members(audited):
    off = {(row.model, row.budget): row for row in audited if row.pack == "off"}
    for (model, budget), kind in EXPECTED_OFF[running_on_simulated_core()].items():
        assert off[(model, budget)].count(kind)[0] > 0, (model, budget, kind)


def test_accepted_findings_say_why(audited):
    assert all(len(f.accepted) > 40 for row in audited for f in row.findings if f.accepted)


def test_full_load_has_nothing_to_report(audited):
    assert any(row.budget == "full" and not row.not_audited for row in audited)
    assert all(not row.findings for row in audited if row.budget == "full")


def test_peak_memory_is_far_below_the_weights(audited):
    """Full-size weights are FakeTensors: the H3 VAE alone is ~9.7 GB in float32, the process stays near its imports."""
    casts = max(row.weight_cast_bytes for row in audited if not row.not_audited)
    assert casts > 4e9
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 3e9


def test_main_prints_json_and_exits_clean(audited, monkeypatch, capsys):
    monkeypatch.setattr(placement_audit, "BUDGETS", {"none": 0.0})
    monkeypatch.setattr(placement_audit, "audit", lambda budgets=None: audited)
    assert placement_audit.main([], as_json=True) == 0
    assert {row["model"] for row in json.loads(capsys.readouterr().out)} >= ALL_MODELS
