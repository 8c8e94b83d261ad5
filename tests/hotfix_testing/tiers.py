"""The test tiers (docs/testing.md, "Tiers"; the markers are declared in pyproject.toml), a pytest plugin that
tests/conftest.py loads.

* ``comfyui`` and ``e2e`` are put on every test that takes the ``comfyui`` / ``device_servers`` fixture.
* ``--core NAME``: this run is on a simulated core (tests/hotfix_testing/simulated_cores.py). It selects the tests whose ``cores``
  or ``fails_switched_off`` marker names the core, fails those that skip there, and adds each
  ``fails_switched_off`` test's red control: the same test with its fix switched off, which must fail with the bug's
  own error.
* ``--transformers VERSION``: this run has tests/requirements-transformers-VERSION.txt's transformers first on the
  path; it selects the tests whose ``transformers`` marker names the version and fails those that skip. Every other
  run selects the tests for the venv's own transformers ("latest": those without the marker, or naming it).
* A marker naming a core or a version that no run has stops the collection: nothing drops out of every run unseen.
"""

import os
import traceback
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # tests/

FIX_ON, FIX_OFF = "fix on", "fix off"
LATEST_TRANSFORMERS = "latest"  # the transformers of the venv itself
OTHER_TRANSFORMERS = {path.name.removeprefix("requirements-transformers-").removesuffix(".txt")
                      for path in HERE.glob("requirements-transformers-*.txt")}


def pytest_addoption(parser):
    parser.addoption("--core", metavar="NAME", default=None,
                     help="this run is on the simulated core NAME (tests/hotfix_testing/simulated_cores.py): run only the tests "
                          "marked for it, with their switched-off red controls")
    parser.addoption("--transformers", metavar="VERSION", default=LATEST_TRANSFORMERS,
                     help="this run has the transformers of tests/requirements-transformers-VERSION.txt on its path: "
                          "run only the tests marked for it")


def pytest_configure(config):
    from hotfix_testing import simulated_cores

    # A user who switched the pack off has MINIMAX_HOTFIX_DISABLE exported; tests that want it set it themselves.
    os.environ.pop("MINIMAX_HOTFIX_DISABLE", None)
    core = config.getoption("core")
    if core is not None:
        if core not in simulated_cores.CORES:
            raise pytest.UsageError(f"--core {core!r}: no such simulated core (known: {', '.join(simulated_cores.CORES)})")
        earlier = os.environ.get(simulated_cores.SIMULATED_CORE_ENV)
        os.environ[simulated_cores.SIMULATED_CORE_ENV] = core
        # put back when the session ends: a run inside another (tests/test_tiers.py) must not leave its core behind
        config.add_cleanup(lambda: os.environ.pop(simulated_cores.SIMULATED_CORE_ENV) if earlier is None
                           else os.environ.__setitem__(simulated_cores.SIMULATED_CORE_ENV, earlier))
    version = config.getoption("transformers")
    if version != LATEST_TRANSFORMERS:
        import transformers

        if version not in OTHER_TRANSFORMERS or not transformers.__version__.startswith(version):
            raise pytest.UsageError(f"--transformers {version}: this run imports transformers {transformers.__version__} "
                                    f"(tests/requirements-transformers-{version}.txt is put on PYTHONPATH by tools/test.sh)")


def cores_named(item) -> set[str]:
    """The simulated cores a test must pass on: its ``cores`` marker's and its ``fails_switched_off`` marker's."""
    names = {name for marker in item.iter_markers("cores") for name in marker.args}
    return names | {name for marker in item.iter_markers("fails_switched_off") for name in marker.kwargs["cores"]}


def transformers_of(item) -> set[str]:
    """The transformers versions whose runs a test belongs to (its closest ``transformers`` marker); latest alone
    when it has none."""
    marker = item.get_closest_marker("transformers")
    return set(marker.args) if marker is not None else {LATEST_TRANSFORMERS}


def pytest_generate_tests(metafunc):
    """The red control of a ``fails_switched_off`` test, on the cores its marker names: the test once more with the
    fix switched off (``fix_switch``, an autouse fixture below)."""
    markers = list(metafunc.definition.iter_markers("fails_switched_off"))
    markers += [mark for parametrize in metafunc.definition.iter_markers("parametrize")
                for values in parametrize.args[1:2] for value in values
                for mark in getattr(value, "marks", ()) if mark.name == "fails_switched_off"]  # on one parameter
    if any(metafunc.config.getoption("core") in marker.kwargs["cores"] for marker in markers):
        metafunc.parametrize("fix_switch", [FIX_ON, FIX_OFF], indirect=True)


def pytest_collection_modifyitems(config, items):
    from hotfix_testing import simulated_cores

    unknown = sorted(f"{item.nodeid}: {name!r}" for item in items for name in cores_named(item)
                     if name not in simulated_cores.CORES)
    if unknown:  # a core no run builds: the test would drop out of every run
        raise pytest.UsageError("tests marked for a simulated core that tests/hotfix_testing/simulated_cores.py does not build:\n"
                                + "\n".join(unknown))
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "comfyui" in fixtures:
            item.add_marker("comfyui")
        if "device_servers" in fixtures:
            item.add_marker("e2e")
    unknown = sorted(f"{item.nodeid}: {version!r}" for item in items for version in transformers_of(item)
                     if version not in OTHER_TRANSFORMERS | {LATEST_TRANSFORMERS})
    if unknown:  # a version no run installs: the test would drop out of every run
        raise pytest.UsageError("tests marked for a transformers version without tests/requirements-transformers-"
                                "<version>.txt:\n" + "\n".join(unknown))
    core, version = config.getoption("core"), config.getoption("transformers")
    chosen = [item for item in items if version in transformers_of(item)
              and (core is None or core in cores_named(item))
              and not (is_red_control(item) and core not in cores_of_red_control(item))]  # a parameter beside it
    config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
    items[:] = chosen


@pytest.fixture(autouse=True)
def fix_switch(request, monkeypatch):
    """``FIX_OFF`` in a red control (the fix of the test's ``fails_switched_off`` marker switched off by the
    pack's off switch, as a user would); ``FIX_ON`` or None otherwise."""
    switch = getattr(request, "param", None)
    if switch == FIX_OFF:
        from hotfix_testing.registry_state import forget_detection
        from minimax_hotfix import registry as pack_registry

        monkeypatch.setenv(pack_registry.DISABLE_ENV, request.node.get_closest_marker("fails_switched_off").args[0])
        forget_detection(pack_registry)
        yield switch
        forget_detection(pack_registry)
    else:
        yield switch


def is_red_control(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("fix_switch") == FIX_OFF


def cores_of_red_control(item) -> tuple[str, ...]:
    """The cores of the item's own ``fails_switched_off`` marker (none for a parameter beside the marked one)."""
    marker = item.get_closest_marker("fails_switched_off")
    return marker.kwargs["cores"] if marker is not None else ()


def red_control_marker(item):
    """The ``fails_switched_off`` marker of a red control item, else None."""
    return item.get_closest_marker("fails_switched_off") if is_red_control(item) else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A red control passes when its test fails with the bug's error, and fails when the test passes (it could not
    fail: the bug did not reproduce) or fails otherwise."""
    marker = red_control_marker(item)
    if marker is None:
        return (yield)
    fix_id, error = marker.args
    try:
        yield
    except pytest.skip.Exception:
        raise
    except BaseException as exc:  # noqa: B036 (pytest.fail's own exception is a BaseException)
        shown = "".join(traceback.format_exception_only(type(exc), exc))
        if error not in shown:
            raise AssertionError(f"with {fix_id} switched off the test failed, but without the bug's error "
                                 f"{error!r}: {shown}") from exc
        return None
    pytest.fail(f"with {fix_id} switched off the test passed: the bug did not reproduce, so the green test cannot "
                "fail without its fix")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """On a simulated core or another transformers, a test marked for it must run there: a skip is a failure."""
    report = yield
    core, version = item.config.getoption("core"), item.config.getoption("transformers")
    run = f"the simulated core {core!r}" if core is not None else (
        f"transformers {version}" if version != LATEST_TRANSFORMERS else None)
    if run is not None and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped on {run}, which its marker says it must pass on: {reason}"
    return report
