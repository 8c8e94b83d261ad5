"""Offers the ``comfyui`` fixture for tests that need a real ComfyUI checkout (COMFYUI_PATH; skipped without it), the
``registry`` fixture (the only place tests touch the registry's private state), ``fresh_detection`` and the
simulated-device servers (``device_models``, ``device_servers``).

The tiers (markers, ``--core``, ``--transformers``) are the plugin tests/hotfix_testing/tiers.py."""

import os
from pathlib import Path

import pytest

from hotfix_testing.registry_state import forget_detection

HERE = Path(__file__).resolve().parent

pytest_plugins = ["hotfix_testing.tiers", "hotfix_testing.int8_without_int_mm"]


@pytest.fixture(scope="session")
def comfyui():
    """The path of a real ComfyUI, importable and in CPU mode when no GPU is present."""
    if not os.environ.get("COMFYUI_PATH"):
        pytest.skip("needs ComfyUI: runs in the 'with ComfyUI' run of bash tools/test.sh (or set COMFYUI_PATH)")
    from minimax_hotfix.diagnostics.comfyui_checkout import ComfyUIUnavailable, use_comfyui_checkout

    try:
        return use_comfyui_checkout()
    except ComfyUIUnavailable as exc:
        pytest.exit(str(exc), returncode=pytest.ExitCode.USAGE_ERROR)


class RegistryForOneTest:
    """A registry made to hold what one test chooses; ``monkeypatch`` puts every global it touches back after the
    test. The only place tests reach into the registry's private state."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.used = []

    def __call__(self, *fixes, registry=None):
        """``registry`` (the pack's, or the copy ComfyUI loaded) holding only ``fixes``, detected afresh, with the
        off switch's ids not yet checked (so an unknown id is logged again); returns ``fixes``."""
        registry = self._use(registry)
        self.monkeypatch.setattr(registry, "_fixes", {fix.id: fix for fix in fixes})
        return fixes

    def discovering(self, folder):
        """The pack's registry finding its fix modules in ``folder`` afresh, as on a first start-up."""
        from minimax_hotfix import patches

        registry = self._use(None)
        self.monkeypatch.setattr(patches, "__path__", [str(folder)])
        for name, empty in (("_fixes", None), ("_loaded", {}), ("_broken_modules", {})):
            self.monkeypatch.setattr(registry, name, empty)
        return registry

    def _use(self, registry):
        if registry is None:
            from minimax_hotfix import registry
        self.monkeypatch.setattr(registry, "_checked_ids", set())
        forget_detection(registry)
        self.used.append(registry)
        return registry

    def forget(self):
        for registry in self.used:
            forget_detection(registry)


@pytest.fixture
def registry(monkeypatch):
    """``registry(*fixes)``: the pack's registry holding only these fixes (``registry=`` another copy of it), with
    fresh detection; ``registry.discovering(folder)``: the registry finding its fix modules in ``folder``."""
    chosen = RegistryForOneTest(monkeypatch)
    yield chosen
    chosen.forget()


@pytest.fixture
def fresh_detection(monkeypatch, fix_switch):
    """Every fix detected afresh, with the off switch unset (but in a red control, tests/hotfix_testing/tiers.py, whose fix it
    switches off); forgotten again after the test."""
    from hotfix_testing.tiers import FIX_OFF
    from minimax_hotfix import registry as pack_registry

    if fix_switch != FIX_OFF:
        monkeypatch.delenv(pack_registry.DISABLE_ENV, raising=False)
    forget_detection(pack_registry)
    yield
    forget_detection(pack_registry)


@pytest.fixture(scope="session")
def device_models(tmp_path_factory, comfyui):
    """A models folder with every synthetic model (tests/hotfix_testing/synthetic_models.py), shared by the servers below; they
    carry the official templates' file names, and each LoRA a template names is there as a LoRA without weights."""
    from hotfix_testing import synthetic_models
    from hotfix_testing.workflow_prompts import official_template_inputs

    folder = tmp_path_factory.mktemp("device_models")
    written = synthetic_models.write_models(folder)
    models, _ = official_template_inputs()
    for kind, name in models:
        if kind == "loras" and name not in written:
            synthetic_models.write_empty_lora(folder / kind / name)
    return folder


@pytest.fixture(scope="session")
def device_int8_models(tmp_path_factory, comfyui):
    """(int8, dense): models folders with the H3 models, the DiT and video VAE int8 ConvRot in the first and
    dequantized in the second (``synthetic_models.write_int8_models``), for the servers below (``models=``)."""
    from hotfix_testing import synthetic_models

    folders = tmp_path_factory.mktemp("device_int8_models") / "int8", tmp_path_factory.mktemp("dense_models") / "dense"
    synthetic_models.write_int8_models(*folders)
    return folders


@pytest.fixture(scope="session")
def device_servers(device_models, tmp_path_factory):
    """``server(core, pack, device, models=None, cache=False, options=())``: (url, object_info, base) of a running ComfyUI on a
    simulated core (tests/hotfix_testing/simulated_cores.py) serving the models folder ``models`` (default ``device_models``) and the
    official templates' input images (small stand-ins in the core's input folder), the probe node installed, started
    once per key and shared by every end-to-end device test of the session (tests/test_seed_scenarios_on_device.py,
    tests/test_official_templates_on_device.py, tests/test_h3_vision_tower_on_device.py). ``--cache-none`` (every
    prompt loads its models afresh) unless ``cache``: then ComfyUI keeps loaded models between prompts, as for a user
    (``--cache-classic``, tests/hotfix_testing/comfyui_server.py: whatever the machine's free RAM)."""
    import contextlib
    import time

    from hotfix_testing import simulated_cores, synthetic_models
    from hotfix_testing.comfyui_server import SimulatedDevice, comfyui_with_pack
    from hotfix_testing.workflow_prompts import official_template_inputs

    cores, running = {}, {}
    with contextlib.ExitStack() as stack:
        def server(core: str, pack: bool, device: SimulatedDevice | None, models: Path | None = None,
                   cache: bool = False, options: tuple[str, ...] = ()):
            models = models or device_models
            key = (core, pack, device, models, cache, options)
            if key not in running:
                if core not in cores:
                    cores[core] = simulated_cores.build_core(core, tmp_path_factory.mktemp("core") / "ComfyUI")
                    for name in official_template_inputs()[1]:
                        synthetic_models.write_input_image(cores[core] / "input" / name)
                base = tmp_path_factory.mktemp("server")
                (base / "models").symlink_to(models, target_is_directory=True)
                started = time.monotonic()
                url, object_info = stack.enter_context(comfyui_with_pack(
                    cores[core], base, HERE / "comfyui_probe", options=(*(() if cache else ("--cache-none",)), *options),
                    device=device, pack=pack))
                print(f"\nserver {core!r} pack={pack} device={device} models={models.name} cache={cache} {options} "
                      f"ready in {time.monotonic() - started:.1f} s")
                running[key] = url, object_info, base
            return running[key]

        yield server


@pytest.fixture(scope="session")
def h3_reference(device_servers):
    """The all-CPU (``--cpu``) run of the seed 000 graph, the reference of every H3 device run."""
    from hotfix_testing.seed_scenarios import REFERENCE_CORE, run, workflows

    reference = run(device_servers(REFERENCE_CORE, True, None), workflows()[0], "cpu_reference")
    assert reference["error"] is None, reference["error"]
    return reference


@pytest.fixture(scope="session")
def h3_int8_reference(device_servers, device_int8_models):
    """The all-CPU (``--cpu``) run of the seed 004 graph with the dense (dequantized) copies of the int8 models."""
    from hotfix_testing.seed_scenarios import run, workflows

    reference = run(device_servers("0.33.0", True, None, device_int8_models[1]), workflows()[0], "int8_cpu_reference")
    assert reference["error"] is None, reference["error"]
    return reference


@pytest.fixture(scope="session")
def music3_reference(device_servers):
    """The all-CPU (``--cpu``) run of the Music 3 graph, the reference of every Music 3 device run (either loader)."""
    from hotfix_testing.seed_scenarios import named, run, workflows

    scenario = named("seed 002 Music 3")
    reference = run(device_servers(scenario.cores[0], True, None), workflows(scenario.workflow)[0], "music3_cpu",
                    make_prompt=scenario.make_prompt, probes=scenario.probes)
    assert reference["error"] is None, reference["error"]
    return reference


END_TO_END_TESTS: set[str] = set()  # the tests that use device_servers
END_TO_END_SECONDS: dict[str, float] = {}  # test id -> wall time of its setup, call and teardown
END_TO_END_RAN: set[str] = set()  # those that got to their call (not skipped)


def pytest_collection_modifyitems(items):
    END_TO_END_TESTS.update(item.nodeid for item in items if "device_servers" in getattr(item, "fixturenames", ()))


def pytest_configure(config):
    from hotfix_testing import nested_pytest

    nested_pytest.follow(config)


def pytest_runtest_logreport(report):
    if report.nodeid in END_TO_END_TESTS:
        END_TO_END_SECONDS[report.nodeid] = END_TO_END_SECONDS.get(report.nodeid, 0.0) + report.duration
        if report.when == "call":
            END_TO_END_RAN.add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    """The seed this run shuffled the tests with, the seed scenario table if this run made one (and the wall time of
    the end-to-end device tests), the simulated cores
    it built (with their overlays and stand-ins), and the paths through each fix's code whose random state was
    checked (tests/test_random_state.py)."""
    from hotfix_testing import scenario_table, simulated_cores
    from hotfix_testing.random_state import COVERED_PATHS

    seed = terminalreporter.config.getoption("randomly_seed", None)
    terminalreporter.write_line(f"test order shuffled with --randomly-seed={seed} (docs/testing.md: reproducing it)"
                                if seed is not None else "test order: as written (pytest-randomly off)")
    if scenario_table.ROWS:
        terminalreporter.section("seed scenarios on the simulated accelerator")
        for line in scenario_table.lines():
            terminalreporter.write_line(line)
    if END_TO_END_RAN:
        seconds = sum(END_TO_END_SECONDS[nodeid] for nodeid in END_TO_END_RAN)
        terminalreporter.write_line(f"end-to-end runs on the simulated accelerator: {len(END_TO_END_RAN)} tests, "
                                    f"{seconds:.0f} s (server starts included)")
    if simulated_cores.BUILT:
        terminalreporter.section("simulated cores")
        for name in simulated_cores.BUILT:
            terminalreporter.write_line(simulated_cores.describe(name))
    if COVERED_PATHS:
        where = "with ComfyUI" if os.environ.get("COMFYUI_PATH") else "without ComfyUI"
        terminalreporter.section(f"random state kept, paths covered per fix ({where})")
        for fix_id in sorted(COVERED_PATHS):
            terminalreporter.write_line(f"{fix_id}:")
            for path in dict.fromkeys(COVERED_PATHS[fix_id]):
                terminalreporter.write_line(f"  - {path}")
