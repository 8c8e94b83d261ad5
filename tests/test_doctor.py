"""The doctor prints the environment and every fix, and its exit code follows the self-tests."""

from minimax_hotfix import patches
from minimax_hotfix.patches._fix import Check, Fix, State, Status
from minimax_hotfix.patches._report import run_doctor


class SelfTestedFix(Fix):
    id = "test_self_tested"
    targets = ("vae",)

    def __init__(self, green_passes):
        self.green_passes = green_passes

    def detect(self):
        return Status(State.APPLIED, "test fix")

    def self_test(self):
        yield Check("red: bug reproduces with the fix off", True)
        yield Check("green: fixed output equals the reference", self.green_passes, "max abs diff 0")


def doctor_output():
    lines = []
    return run_doctor(lines.append), "\n".join(lines)


def test_passing_self_tests_exit_zero_and_are_listed(registry):
    registry(SelfTestedFix(green_passes=True))
    code, text = doctor_output()
    assert code == 0
    for expected in ("torch", "comfy-kitchen", "transformers", "devices", "test_self_tested  applied",
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
