"""The doctor prints the environment and every fix, and its exit code follows the self-tests; tools/doctor.py's
options, its JSON document against docs/doctor.schema.json, and its one-line errors."""

import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from hotfix_testing.nested_pytest import pytest_command
from minimax_hotfix.contract import Check, Fix, State, Status
from minimax_hotfix.diagnostics.report import run_doctor

pytestmark = pytest.mark.usefixtures("fresh_detection")  # the fixes under test are on, whatever the off switch says


class SelfTestedFix(Fix):
    id = "test_self_tested"
    targets = ("vae",)

    def __init__(self, green_passes):
        self.green_passes = green_passes

    def detect(self):
        return Status(State.NEEDED, "test fix")

    def self_test(self):
        yield Check("red: bug reproduces with the fix off", True)
        yield Check("green: fixed output equals the reference", self.green_passes, "max abs diff 0")


@pytest.fixture(autouse=True)
def self_tests_of_test_fixes(monkeypatch):
    """A test fix carries its self-test as a method; the pack's fixes have theirs in diagnostics/self_tests/<id>.py."""
    from minimax_hotfix.diagnostics import report

    pack_self_test = report.self_test
    monkeypatch.setattr(report, "self_test",
                        lambda fix: fix.self_test() if hasattr(fix, "self_test") else pack_self_test(fix))


def doctor_output():
    lines = []
    return run_doctor(lines.append), "\n".join(lines)


def test_passing_self_tests_exit_zero_and_are_listed(registry):
    registry(SelfTestedFix(green_passes=True))
    code, text = doctor_output()
    assert code == 0
    for expected in ("torch", "comfy-kitchen", "transformers", "devices", "test_self_tested  needed",
                     "ok    red: bug reproduces", "all self-tests passed"):
        assert expected in text


def test_a_failing_self_test_makes_the_doctor_fail(registry):
    registry(SelfTestedFix(green_passes=False))
    code, text = doctor_output()
    assert code == 1 and "FAIL  green: fixed output equals the reference" in text


def test_a_raising_self_test_makes_the_doctor_fail(registry):
    fix = SelfTestedFix(green_passes=True)
    fix.self_test = lambda: (_ for _ in ()).throw(RuntimeError("no device"))
    registry(fix)
    code, text = doctor_output()
    assert code == 1 and "self-test raised RuntimeError: no device" in text


def test_with_no_fix_registered_it_says_so(registry):
    registry()
    code, text = doctor_output()
    assert code == 0 and "No fix is registered yet." in text


# ---- the command: tools/doctor.py ----------------------------------------------------------------------------

DOCTOR = Path(__file__).resolve().parents[1] / "tools" / "doctor.py"
SCHEMA = json.loads((DOCTOR.parents[1] / "docs" / "doctor.schema.json").read_text(encoding="utf-8"))
VALIDATOR = Draft202012Validator(SCHEMA)


def schema_errors(value) -> list[str]:
    """Where and why ``value`` breaks docs/doctor.schema.json (the jsonschema library)."""
    return [f"$.{'.'.join(map(str, error.absolute_path))}: {error.message}" for error in VALIDATOR.iter_errors(value)]


def doctor(*args, env=None, python=sys.executable):
    return subprocess.run([python, str(DOCTOR), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "100", **(env or {})})


@pytest.fixture(scope="module")
def json_run():
    """One full ``doctor --json`` run: every real fix, its state and its self-test, in this test's Python."""
    return doctor("--json")


def test_json_output_matches_its_schema(json_run):
    report = json.loads(json_run.stdout)  # stdout holds the document alone
    assert schema_errors(report) == []
    assert json_run.returncode == report["exit_code"] == 0
    assert {fix["id"] for fix in report["fixes"]} == {test["fix"] for test in report["self_tests"]} >= {"ck_rope_device"}
    assert report["environment"]["pack_version"] == report_module().pack_version() != "unknown"

    # Red controls: the validator rejects a missing key, a wrong type and an unknown state.
    broken = json.loads(json_run.stdout)
    del broken["environment"]["os"]
    broken["failed_steps"] = "0"
    broken["fixes"][0]["state"] = "off"
    assert len(schema_errors(broken)) == 3


def test_json_keeps_stdout_clean_and_shows_progress_on_stderr(json_run):
    """The self-tests' progress (tqdm, or plain lines without it) goes to stderr: stdout stays one JSON document."""
    report = json.loads(json_run.stdout)
    total = len(report["self_tests"])
    assert "self-tests" in json_run.stderr and f"{total}/{total}" in json_run.stderr, json_run.stderr[-2000:]
    assert "self-tests" not in json_run.stdout


def test_json_says_where_each_fix_is_attached(json_run):
    """The doctor loads no user model: a per-model fix is attached to none, a needed process-wide one is installed."""
    attached = {fix["id"]: fix["attached"] for fix in json.loads(json_run.stdout)["fixes"]}
    assert attached["vae_qk_norm_scale"] == {"loaded_models": 0, "modules_hooked_last_load": None,
                                             "installed_process_wide": None}
    assert attached["ck_rope_device"]["installed_process_wide"] is False  # the doctor installs nothing


def test_the_schema_lists_every_state():
    assert SCHEMA["properties"]["fixes"]["items"]["properties"]["state"]["enum"] == [state.value for state in State]


def test_json_shows_each_fix_retirement(json_run):
    fixes = json.loads(json_run.stdout)["fixes"]
    assert fixes and all(fix["fixed_by"] not in (None, "unknown") and fix["delete_when"] not in (None, "unknown")
                         for fix in fixes), fixes


def test_every_self_test_with_a_red_control_prints_it_before_green(json_run):
    tests = json.loads(json_run.stdout)["self_tests"]
    kinds = [[step["kind"] for step in test["steps"]] for test in tests if any(step["kind"] == "red" for step in test["steps"])]
    assert kinds and all(k.index("red") < k.index("green") for k in kinds), kinds
    assert all(step["passed"] for test in tests for step in test["steps"])


def report_module():
    from minimax_hotfix.diagnostics import report as _report

    return _report


def troubleshooting() -> str:
    readme = (DOCTOR.parents[1] / "README.md").read_text(encoding="utf-8")
    return readme[readme.index("## Troubleshooting"):readme.index("## For developers")]


def test_every_doctor_message_is_in_the_readme_troubleshooting():
    for message in ("doctor: error: torch is not installed in", "is not a ComfyUI checkout (no comfy/cli_args.py and "
                    "nodes.py there)", "cannot be imported by", "doctor: error: unknown fix id",
                    "doctor: error: the placement audit is not available in this version",
                    "placement audit: <file>: no such file", "cannot be read as safetensors (...)", "as GGUF (...)",
                    "not a MiniMax model ComfyUI can build (...)", "loader cannot build it (...)", "FAIL  ",
                    "self-test step(s) failed", "FAIL  self-test raised", "(not run here:",
                    "module failed to import: ", "fix left off", "failed to import and is left off",
                    "switched off by MINIMAX_HOTFIX_DISABLE", "MINIMAX_HOTFIX_DISABLE names no known fix",
                    "not loaded (set COMFYUI_PATH to check a ComfyUI checkout)",
                    "doctor: error: no MiniMax Hotfix fix is known for this error",
                    "repair errors with this message; pass the whole traceback"):
        assert message in troubleshooting(), message


def run_main(capsys, *argv):
    from doctor import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_and_version_run_nothing_else(capsys):
    with pytest.raises(SystemExit) as done:
        run_main(capsys, "--help")
    assert done.value.code == 0 and "--fix ID" in capsys.readouterr().out
    code, out, err = run_main(capsys, "--version")
    commit = report_module().pack_commit()
    assert code == 0 and out == f"minimax-hotfix {report_module().pack_version()} " \
                                f"({f'git {commit}' if commit else 'not a git checkout'})\n" and err == ""


class FailingFix(SelfTestedFix):
    id = "test_failing"


def test_fix_runs_one_self_test_and_ids_ignore_case(registry, capsys):
    registry(SelfTestedFix(green_passes=True), FailingFix(green_passes=False))
    code, out, _ = run_main(capsys, "--fix", "TEST_SELF_TESTED")
    assert code == 0 and "self-test test_self_tested:" in out and "test_failing" not in out
    # Red control: the whole doctor runs the failing fix too.
    code, out, _ = run_main(capsys)
    assert code == 1 and "self-test test_failing:" in out


def test_an_unknown_fix_id_lists_the_known_ones(registry, capsys):
    registry(SelfTestedFix(green_passes=True))
    code, out, err = run_main(capsys, "--fix", "test_self_test")
    assert (code, out) == (2, "")
    assert err == "doctor: error: unknown fix id 'test_self_test'; known ids: test_self_tested\n"


class VaeFix(SelfTestedFix):
    id = "vae_qk_norm_scale"


VAE_TRACEBACK = """Traceback (most recent call last):
  File "C:\\ComfyUI\\comfy\\ldm\\minimax\\vae.py", line 301, in forward
    query, key = rms_rope(
RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!
"""


def test_explain_names_the_fix_of_a_pasted_error_then_runs_it_alone(registry, capsys, monkeypatch):
    registry(VaeFix(green_passes=True), FailingFix(green_passes=False))
    monkeypatch.setattr(sys, "stdin", io.StringIO(VAE_TRACEBACK))
    code, out, _ = run_main(capsys, "--explain", "-")
    assert code == 0 and out.startswith("vae_qk_norm_scale: MiniMax H3's video VAE was loaded partly")
    assert "self-test vae_qk_norm_scale:" in out and "test_failing" not in out
    code, out, err = run_main(capsys, "--explain", VAE_TRACEBACK, "--json")
    assert code == 0 and json.loads(out)["fixes"][0]["id"] == "vae_qk_norm_scale"
    assert err.startswith("vae_qk_norm_scale: ")


@pytest.mark.parametrize("text,says", [
    ("RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
     "doctor: error: fixes ck_rope_device, transformers_qwen3vl_pos_embed, transformers_static_cache, "
     "vae_qk_norm_scale repair errors with this message; pass the whole traceback"),
    ("torch.OutOfMemoryError: CUDA out of memory.", "doctor: error: no MiniMax Hotfix fix is known for this error"),
])
def test_explain_says_when_an_error_names_no_single_fix(capsys, text, says):
    code, out, err = run_main(capsys, "--explain", text)
    assert (code, out) == (2, "") and err.startswith(says) and err.count("\n") == 1


def test_audit_calls_the_placement_audit(monkeypatch, capsys):
    import doctor

    seen = []
    audit = types.SimpleNamespace(main=lambda files, as_json: seen.append((files, as_json)) or 3)
    monkeypatch.setitem(sys.modules, doctor.AUDIT_MODULE, audit)
    assert run_main(capsys, "--audit", "a.safetensors", "b.gguf", "--json")[0] == 3
    assert seen == [(["a.safetensors", "b.gguf"], True)]


def test_audit_missing_from_this_version_says_so(monkeypatch, capsys):
    import doctor

    monkeypatch.setitem(sys.modules, doctor.AUDIT_MODULE, None)  # the import fails as if the module were absent
    code, out, err = run_main(capsys, "--audit")
    assert (code, out, err) == (2, "", "doctor: error: the placement audit is not available in this version\n")


def test_without_torch_one_line_says_where_to_run_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # find_spec answers "not installed"
    code, out, err = run_main(capsys)
    assert (code, out) == (2, "")
    assert err == f"doctor: error: torch is not installed in {sys.executable}: run the doctor in the pack's test " \
                  "environment (bash tools/venv.sh python tools/doctor.py) or with ComfyUI's own Python\n"


def fake_comfyui(root: Path, model_patcher: str) -> Path:
    (root / "comfy").mkdir(parents=True)
    (root / "nodes.py").write_text("")
    (root / "comfy" / "__init__.py").write_text("")
    (root / "comfy" / "cli_args.py").write_text("import types\nargs = types.SimpleNamespace(cpu=False)\n")
    (root / "comfy" / "model_patcher.py").write_text(model_patcher)
    return root


@pytest.mark.parametrize("case", ["no such folder", "not a ComfyUI tree", "requirements missing"])
def test_an_unusable_comfyui_path_gives_one_line_and_exit_2(tmp_path, case):
    if case == "no such folder":
        root, expected = tmp_path / "nowhere", "is not a ComfyUI checkout"
    elif case == "not a ComfyUI tree":
        (tmp_path / "main.py").write_text("")
        root, expected = tmp_path, "is not a ComfyUI checkout"
    else:
        root = fake_comfyui(tmp_path / "ComfyUI", "import a_comfyui_requirement_not_installed\n")
        expected = "(No module named 'a_comfyui_requirement_not_installed'): run with ComfyUI's own Python, or " \
                   f"install its requirements: {sys.executable} -m pip install -r {root / 'requirements.txt'}"
    done = doctor(env={"COMFYUI_PATH": str(root)})
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("doctor: error: ") and expected in done.stderr and done.stderr.count("\n") == 1


def test_pytest_with_an_unusable_comfyui_path_stops_with_one_message(tmp_path):
    done = subprocess.run(pytest_command(str(Path(__file__).parent / "test_nodes.py")), capture_output=True, text=True,
                          timeout=600,
                          env={**os.environ, "COMFYUI_PATH": str(tmp_path)}, cwd=DOCTOR.parents[1])
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert f"COMFYUI_PATH={tmp_path} is not a ComfyUI checkout" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr and "ModuleNotFoundError" not in done.stdout + done.stderr


def test_reasons_wrap_to_the_width():
    lines = []
    report_module().run_doctor(lines.append, fixes=[], width=60)
    assert lines and all(len(line) <= 60 for text in lines for line in text.splitlines())
