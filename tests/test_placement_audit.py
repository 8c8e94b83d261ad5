"""The placement audit (diagnostics/placement_audit.py) on the core under test (0.33.0 in CI's ComfyUI run) and, in
subprocesses, on the simulated cores that change the audited models' code. Real classes at their real
configuration on FakeTensor weights, loaded by ComfyUI's real ModelPatcher; pack on must leave nothing."""

import fnmatch
import json
import resource
import time

import pytest
import torch

from hotfix_testing.newer_linear_input_act import use_newer_linear_input_act
from hotfix_testing.simulated_cores import running_on_simulated_core
from minimax_hotfix import registry as pack_registry
from minimax_hotfix.diagnostics import placement_audit, placement_runs
from minimax_hotfix.diagnostics.placement_models import AuditedModel
from minimax_hotfix.diagnostics.placement_recorder import COMPUTE

BUDGETS = ("none", "50%", "full", "dynamic")
# the slowest models on FakeTensors (~7,000 ops per call; 50-layer and two 36-layer forwards per call): fewer loads,
# the doctor's run has all budgets. No "full" for them: a full load leaves no model tensor on the offload device, so
# it can only show a stray input, which every other budget shows too (~60 s of CI for no information)
BUDGETS_BY_MODEL = {"H3 audio VAE": ("none",), "Music 3 text encoder (AR)": ("none", "dynamic"),
                    "H3 DiT": ("none", "50%", "dynamic"), "H3 text encoder: language model": ("none", "50%", "dynamic")}
ALL_MODELS = {"H3 DiT", "H3 video VAE decoder", "H3 video VAE encoder", "H3 audio VAE",
              "H3 text encoder: Qwen3-VL vision tower", "H3 text encoder: language model",
              "Music 3 text encoder (AR)", "Music 3 DiT", "Music 3 DAV"}
H3_VIDEO_VAE = {"H3 video VAE decoder", "H3 video VAE encoder"}
# per simulated core: the models its overlays can change (the others run the 0.33.0 code the main run audits) and the
# budgets; None is the core under test in CI's ComfyUI run (0.33.0)
CORE_MODELS = {
    None: (ALL_MODELS, BUDGETS),
    "0.36/0.37 VAE": (H3_VIDEO_VAE, BUDGETS),  # vae.py
    "fixed VAE": (H3_VIDEO_VAE, BUDGETS),  # vae.py
    # llama.py, ar.py; the partial load that leaves most behind and the dynamic one (the two slowest models)
    "post-#15861 Music 3": ({"Music 3 text encoder (AR)", "H3 text encoder: language model"}, ("none", "dynamic")),
    # qwen35.py holds the tower only: the language model runs 0.33.0's llama.py and qwen3vl.py there
    "0.38 Qwen3-VL": ({"H3 text encoder: Qwen3-VL vision tower"}, BUDGETS),
    # ops.py: every model's layers, all cast at the none budget; the H3 language model's layers are llama.py's Linear,
    # RMSNorm and Embedding, as the Music 3 AR's
    "fixed int8": (ALL_MODELS - {"H3 text encoder: language model"}, ("none",)),
    # ar.py differs from post-#15861's only in generate()'s loop (decode_buffers), which the audit runs call for call;
    # llama.py is the same file: the AR at the budget that leaves most behind
    "fixed Music 3": ({"Music 3 text encoder (AR)"}, ("none",)),
    # model.py, vae.py, qwen35.py, llama.py, ar.py: these six models' own code, with the newer ops.py's casts, at none
    # (the H3 audio VAE, Music 3 DiT and DAV, 0.33.0 code under this ops.py, gave their 0.33.0 rows when measured
    # once). No dynamic: this ops.py's vbar cast reads the _pin_state["fast_disk"] that only a newer model_patcher.py
    # sets (0.33.0's ModelPatcherDynamic: KeyError 'fast_disk')
    "0.39 era": (ALL_MODELS - {"H3 audio VAE", "Music 3 DiT", "Music 3 DAV"}, ("none",)),
}
# what the audit must find with the pack off, per core (a red control for the audit itself)
ON_0_33_0 = {("H3 text encoder: Qwen3-VL vision tower", "none"): "host build",
             ("H3 video VAE encoder", "none"): "host-to-device", ("H3 DiT", "none"): "host-to-device",
             ("Music 3 DAV", "none"): "cross-device"}
EXPECTED_OFF = {
    None: {**ON_0_33_0, ("Music 3 DAV", "50%"): "cross-device",
           ("H3 text encoder: Qwen3-VL vision tower", "dynamic"): "host build"},
    "fixed int8": ON_0_33_0,
    "0.38 Qwen3-VL": {("H3 text encoder: Qwen3-VL vision tower", "none"): "host build",
                      ("H3 text encoder: Qwen3-VL vision tower", "50%"): "host build",
                      ("H3 text encoder: Qwen3-VL vision tower", "dynamic"): "host build"},
    "0.36/0.37 VAE": {("H3 video VAE decoder", "none"): "cross-device", ("H3 video VAE decoder", "50%"): "cross-device"},
    "fixed VAE": {("H3 video VAE decoder", "none"): "host-to-device", ("H3 video VAE encoder", "none"): "host-to-device"},
    "post-#15861 Music 3": {},  # nothing: the AR and the language model leave no tensor behind there
    "fixed Music 3": {},
    "0.39 era": {**{load: kind for load, kind in ON_0_33_0.items() if load[0] != "Music 3 DAV"},
                 ("H3 video VAE decoder", "none"): "host-to-device"},
}


@pytest.fixture(scope="module")
def audited(comfyui):
    patch = pytest.MonkeyPatch()
    use_newer_linear_input_act(patch.setattr)  # the newer VAE's call form, where this core lacks it
    audited_models, budgets = CORE_MODELS[running_on_simulated_core()]
    start = time.perf_counter()
    rows = placement_runs.audit(budgets, {  # no budget: not run on this core
        model: tuple(b for b in BUDGETS_BY_MODEL.get(model, budgets) if b in budgets) if model in audited_models else ()
        for model in ALL_MODELS})
    seconds = time.perf_counter() - start
    patch.undo()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nplacement audit on {running_on_simulated_core() or 'this core'}: {seconds:.1f} s, peak RSS "
          f"{peak_mb:.0f} MB\n{placement_runs.table(rows)}")
    return rows


def test_every_model_is_audited_or_says_why(audited):
    audited_models, budgets = CORE_MODELS[running_on_simulated_core()]
    assert {row.model for row in audited} >= audited_models
    assert all(row.not_audited or row.budget in BUDGETS_BY_MODEL.get(row.model, budgets) for row in audited)


@pytest.mark.cores("0.36/0.37 VAE", "fixed VAE", "post-#15861 Music 3", "fixed int8", "0.38 Qwen3-VL", "fixed Music 3", "0.39 era")
def test_pack_on_leaves_no_cross_device_op_and_no_host_work(audited):
    on = [row for row in audited if row.pack == "on" and not row.not_audited]
    assert on
    left = [(row.model, row.budget, f) for row in on for f in row.findings if not f.accepted]
    assert left == []


@pytest.mark.cores("0.36/0.37 VAE", "fixed VAE", "post-#15861 Music 3", "fixed int8", "0.38 Qwen3-VL", "fixed Music 3", "0.39 era")
def test_pack_off_finds_the_known_members(audited):
    """Where a core's models have no known member, the audit must find none there either (a new one fails this)."""
    off = {(row.model, row.budget): row for row in audited if row.pack == "off"}
    expected = EXPECTED_OFF[running_on_simulated_core()]
    for (model, budget), kind in expected.items():
        assert off[(model, budget)].count(kind)[0] > 0, (model, budget, kind)
    if not expected:
        assert off and all(not row.not_audited and not row.findings for row in off.values())


def test_accepted_findings_say_why(audited):
    assert all(len(f.accepted) > 40 for row in audited for f in row.findings if f.accepted)


def test_full_load_has_nothing_to_report(audited):
    full = [row for row in audited if row.budget == "full" and not row.not_audited]
    assert full or "full" not in CORE_MODELS[running_on_simulated_core()][1]
    assert all(not row.findings for row in full)


def test_peak_memory_is_far_below_the_weights(audited):
    """Full-size weights are FakeTensors: the process stays under 3 GB, near its imports (and the earlier tests of the
    same process), while one call of the largest model audited casts gigabytes of weights (the H3 VAE alone ~9.7 GB in
    float32; on the 0.38 core, whose only model is the vision tower, 1.19 GB)."""
    casts = max(row.weight_cast_bytes for row in audited if not row.not_audited)
    assert casts > 1e9
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 3e9


def test_every_accepted_entry_matches_a_measured_finding(audited):
    """A stale ``ACCEPTED`` entry (its finding gone, its tensor renamed) fails here, on every core that audits its
    model, unless the entry shows only where a fix reads another state (``SHOWS_WHERE``)."""
    audited_models = {row.model for row in audited if not row.not_audited}
    found = [(row.model, f.tensor, f.kind) for row in audited for f in row.findings]

    def shows_here(key) -> bool:
        where = placement_runs.SHOWS_WHERE.get(key)
        if callable(where):
            return where()
        return where is None or pack_registry.status(pack_registry.fix_named(where[0])).state.value == where[1]

    stale = [key for key in placement_runs.ACCEPTED if key[0] in audited_models and shows_here(key)
             and not any(m == key[0] and k == key[2] and fnmatch.fnmatchcase(t, key[1]) for m, t, k in found)]
    assert stale == []


def test_audit_shows_progress_on_stderr_and_keeps_json_on_stdout(monkeypatch, capsys, comfyui):
    """``doctor --audit --json``: one progress step per model x budget x pack on stderr; stdout the JSON alone."""
    linear = AuditedModel("tiny linear", "model", lambda: torch.nn.Linear(4, 4),
                          lambda model, fake_mode: model(torch.empty(1, 4, device=COMPUTE)))
    monkeypatch.setattr(placement_runs, "models", lambda: [linear])
    monkeypatch.setattr(placement_runs, "BUDGETS", {"none": 0.0})
    placement_audit.main([], as_json=True)
    out, err = capsys.readouterr()
    assert [(row["model"], row["budget"], row["pack"]) for row in json.loads(out)] == [
        ("tiny linear", budget, pack) for budget in ("none", "dynamic") for pack in ("off", "on")]
    assert "placement audit" in err and "4/4" in err and "tiny linear x dynamic x pack on" in err, err


def test_main_prints_json_and_exits_clean(audited, monkeypatch, capsys):
    monkeypatch.setattr(placement_runs, "BUDGETS", {"none": 0.0})
    monkeypatch.setattr(placement_audit, "audit", lambda budgets=None, show_progress=False: audited)
    assert placement_audit.main([], as_json=True) == 0
    assert {row["model"] for row in json.loads(capsys.readouterr().out)} >= CORE_MODELS[running_on_simulated_core()][0]
