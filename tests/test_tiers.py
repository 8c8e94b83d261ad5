"""The tiers plugin (tests/hotfix_testing/tiers.py) run on small test files of its own (pytester): a core's run selects by marker,
a skip there is a failure, a marker naming no run stops the collection, and each red control passes only when its
test fails with the bug's error."""

import pytest

pytest_plugins = ["pytester"]

CORE = "0.36/0.37 VAE"
FIX = "vae_qk_norm_scale"

# a stand-in for a fix's green test: it fails with ``error`` whenever the pack's off switch names the fix
GREEN_TEST = '''
import os
import pytest

@pytest.mark.fails_switched_off("{fix}", "the bug's own error", cores=("{core}",))
def test_green():
    if "{fix}" in os.environ.get("MINIMAX_HOTFIX_DISABLE", ""):
        raise RuntimeError({error!r})

@pytest.mark.cores("{core}")
def test_marked_for_the_core():
    pass

def test_not_marked():
    pass
'''


@pytest.fixture
def tiers(pytester):
    pytester.makeconftest('pytest_plugins = ["hotfix_testing.tiers"]\n')
    pytester.makeini("[pytest]\nmarkers =\n    cores\n    fails_switched_off\n    transformers\n")

    def run(error: str, *args: str):
        pytester.makepyfile(test_fix=GREEN_TEST.format(fix=FIX, core=CORE, error=error))
        return pytester.runpytest_inprocess("-p", "no:randomly", *args)

    return run


def test_a_core_run_selects_the_marked_tests_and_the_red_control_passes_on_the_bug(tiers):
    result = tiers("the bug's own error", "--core", CORE, "-v")
    result.assert_outcomes(passed=3, deselected=1)
    result.stdout.fnmatch_lines(["*test_green?fix on? PASSED*", "*test_green?fix off? PASSED*"])


def test_without_a_core_the_test_runs_once_and_no_red_control_is_added(tiers):
    tiers("the bug's own error").assert_outcomes(passed=3)


def test_red_control_fails_when_the_test_fails_with_another_error(tiers):
    result = tiers("another error than the one the marker names", "--core", CORE)
    result.assert_outcomes(passed=2, failed=1, deselected=1)
    result.stdout.fnmatch_lines(["*without the bug's error*"])


def test_red_control_fails_when_the_bug_did_not_reproduce(tiers, pytester):
    pytester.makepyfile(test_fix=GREEN_TEST.format(fix=FIX, core=CORE, error="").replace(
        "raise RuntimeError('')", "pass"))
    result = pytester.runpytest_inprocess("-p", "no:randomly", "--core", CORE)
    result.assert_outcomes(passed=2, failed=1, deselected=1)
    result.stdout.fnmatch_lines(["*switched off the test passed: the bug did not reproduce*"])


def test_a_skip_on_the_core_it_is_marked_for_fails(tiers, pytester):
    pytester.makepyfile(test_skips=f'import pytest\n\n@pytest.mark.cores("{CORE}")\ndef test_x():\n'
                                   '    pytest.skip("not on this core")\n')
    result = tiers("the bug's own error", "--core", CORE)
    result.assert_outcomes(passed=3, failed=1, deselected=1)
    result.stdout.fnmatch_lines([f"*skipped on the simulated core '{CORE}', which its marker says it must pass on*"])


def test_a_marker_naming_a_core_no_run_builds_stops_the_collection(tiers, pytester):
    pytester.makepyfile(test_unknown='import pytest\n\n@pytest.mark.cores("0.99 nowhere")\ndef test_x():\n    pass\n')
    result = tiers("the bug's own error")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_unknown.py::test_x: '0.99 nowhere'*"])


def test_a_marker_naming_a_transformers_no_run_installs_stops_the_collection(tiers, pytester):
    pytester.makepyfile(test_unknown='import pytest\n\n@pytest.mark.transformers("4.0")\ndef test_x():\n    pass\n')
    result = tiers("the bug's own error")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_unknown.py::test_x: '4.0'*"])
