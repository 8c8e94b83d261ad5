"""The registry's guarantees, each with a red control showing the check catches a broken variant.

Runs on the stand-in patcher everywhere and on ComfyUI's real ModelPatcher when COMFYUI_PATH is set."""

import logging

import pytest
import torch

from hotfix_testing.counting_fix import CountingFix, tiny_model
from hotfix_testing.patchers import ComfyBackend, StandInBackend
from minimax_hotfix import patches
from minimax_hotfix import registry as pack_registry
from minimax_hotfix.contract import State, Status

pytestmark = pytest.mark.usefixtures("fresh_detection")  # the guarantees hold for fixes the off switch leaves on


@pytest.fixture(params=["stand-in", "comfyui"])
def backend(request):
    if request.param == "stand-in":
        return StandInBackend()
    request.getfixturevalue("comfyui")
    return ComfyBackend()


class RaisingDetectFix(CountingFix):
    id = "test_raising_detect"

    def detect(self):
        raise RuntimeError("target moved")


def run(model):
    return model(torch.ones(1, 4))


def hook_state(model):
    """Hooks and instance attributes of every module, less the bookkeeping ComfyUI's own loads add."""
    own = lambda m: sorted(k for k in vars(m) if not k.startswith("comfy_"))  # noqa: E731
    return [(name, list(m._forward_pre_hooks.values()), own(m)) for name, m in model.named_modules()]


def calls_per_forward(fix, backend, patcher):
    backend.load(patcher)
    before = fix.calls
    run(patcher.model)
    backend.unload(patcher)
    return fix.calls - before


def test_attaching_twice_equals_attaching_once(backend, registry):
    (fix,) = registry(CountingFix())
    patcher = backend.patcher(tiny_model())
    pack_registry.attach_fixes(patcher, "model")
    pack_registry.attach_fixes(patcher, "model")
    assert calls_per_forward(fix, backend, patcher) == 2  # two Linear layers, one hook each

    # Red control: the same fix attached under a second key stacks, and the count shows it.
    fix.attach(patcher, "some.other.key")
    assert calls_per_forward(fix, backend, patcher) == 4


def test_attaching_to_an_injected_patcher_does_not_stack(backend, registry):
    (fix,) = registry(CountingFix())
    patcher = backend.patcher(tiny_model())
    pack_registry.attach_fixes(patcher, "model")
    backend.load(patcher)
    pack_registry.attach_fixes(patcher, "model")
    before = fix.calls
    run(patcher.model)
    assert fix.calls - before == 2
    backend.unload(patcher)


def test_detaching_restores_the_original_objects(backend, registry):
    registry(CountingFix())
    patcher = backend.patcher(tiny_model())
    original = hook_state(patcher.model)
    reference = run(patcher.model)

    pack_registry.attach_fixes(patcher, "model")
    backend.load(patcher)
    assert patcher.model.hotfixed and hook_state(patcher.model) != original
    pack_registry.detach_fixes(patcher, "model")  # while loaded: the fix must leave at once
    assert hook_state(patcher.model) == original
    assert not hasattr(patcher.model, "hotfixed")
    assert torch.equal(run(patcher.model), reference)
    backend.unload(patcher)

    # Red control: dropping the injection without ejecting it leaves the hooks behind, and the check sees it.
    pack_registry.attach_fixes(patcher, "model")
    backend.load(patcher)
    patcher.remove_injections(pack_registry.key_for(CountingFix()))
    assert hook_state(patcher.model) != original
    backend.unload(patcher)


def test_a_stock_model_in_the_same_process_is_untouched(backend, registry):
    (fix,) = registry(CountingFix())
    ours, stock = backend.patcher(tiny_model()), backend.patcher(tiny_model())
    pack_registry.attach_fixes(ours, "model")
    assert calls_per_forward(fix, backend, ours) == 2
    assert calls_per_forward(fix, backend, stock) == 0
    assert not hasattr(stock.model, "hotfixed") and not any(k.startswith("minimax_hotfix") for k in stock.injections)

    # A clone of the stock patcher with the fix (what the Apply nodes make) leaves the stock one clean too.
    fixed_clone = stock.clone()
    pack_registry.attach_fixes(fixed_clone, "model")
    assert calls_per_forward(fix, backend, fixed_clone) == 2
    assert calls_per_forward(fix, backend, stock) == 0

    # Red control: attaching to the stock patcher too is caught by the same check.
    pack_registry.attach_fixes(stock, "model")
    assert calls_per_forward(fix, backend, stock) == 2


def test_the_status_counts_only_the_models_a_fix_hooked(backend, registry):
    """"needed" says what the core has; the attachment says what the fix did: a model from a stock loader in the same
    process is not counted, a pack-attached one counts once it is loaded, with the modules hooked at that load."""
    (fix,) = registry(CountingFix())
    fix.link = pack_registry.link_for(fix)
    ours, stock = backend.patcher(tiny_model()), backend.patcher(tiny_model())
    pack_registry.attach_fixes(ours, "model")
    assert str(pack_registry.attachment(fix)) == "attached to no loaded model"  # attached, not loaded yet
    backend.load(stock)
    backend.load(ours)
    # two Linear layers (one hook handle each) and the model itself (its instance attribute)
    assert pack_registry.attachment(fix) == (1, 3, None)
    assert str(pack_registry.attachment(fix)) == "attached to 1 loaded model(s), 3 module(s) hooked (last load)"
    assert pack_registry.status(fix).state is State.NEEDED
    backend.unload(ours)
    backend.unload(stock)

    # Red control: attaching to the stock patcher too is counted.
    pack_registry.attach_fixes(stock, "model")
    backend.load(stock)
    assert pack_registry.attachment(fix).loaded_models == 2
    backend.unload(stock)


def test_fixes_survive_clone_and_rebuild_from_cached_patcher_init(backend, registry):
    (fix,) = registry(CountingFix())
    patcher = backend.patcher(tiny_model(), factory_args=(tiny_model,))
    pack_registry.attach_fixes(patcher, "model")

    clone = patcher.clone()
    assert calls_per_forward(fix, backend, clone) == 2
    rebuilt = backend.rebuild(patcher)
    assert rebuilt.model is not patcher.model
    assert calls_per_forward(fix, backend, rebuilt) == 2

    # Red control: a fix that edits the module tree directly instead of the patcher is lost on rebuild.
    direct = backend.patcher(tiny_model(), factory_args=(tiny_model,))
    fix.hook_loaded_model(direct.model)
    assert calls_per_forward(fix, backend, backend.rebuild(direct)) == 0


def test_a_failing_detection_fails_only_that_fix_and_logs_once(backend, registry, caplog):
    good, bad = registry(CountingFix(), RaisingDetectFix())
    patcher = backend.patcher(tiny_model())
    with caplog.at_level(logging.WARNING, logger="minimax_hotfix"):
        assert pack_registry.attach_fixes(patcher, "model") == [good.id]
        pack_registry.attach_fixes(backend.patcher(tiny_model()), "model")
        assert pack_registry.status(bad).state is State.FAILED
        assert "target moved" in pack_registry.status(bad).reason
    assert [r.getMessage() for r in caplog.records] == [f"MiniMax Hotfix: {bad.id}: {pack_registry.status(bad).reason}"]
    assert calls_per_forward(good, backend, patcher) == 2
    assert bad.calls == 0 and not patcher.get_injections(pack_registry.key_for(bad))  # the failed fix hooks nothing


def test_failed_and_switched_off_are_different_states(monkeypatch, registry):
    good, bad = registry(CountingFix(), RaisingDetectFix())
    monkeypatch.setenv(pack_registry.DISABLE_ENV, good.id)
    assert status_report_rows() == [(good.id, "disabled", f"switched off by {pack_registry.DISABLE_ENV}"),
                                    (bad.id, "failed", "detection failed (RuntimeError: target moved); fix left off")]
    # Red control: switched off too, the failing fix reads "disabled": the switch wins, detection never runs.
    monkeypatch.setenv(pack_registry.DISABLE_ENV, f"{good.id},{bad.id}")
    assert [row[1] for row in status_report_rows()] == ["disabled", "disabled"]


def status_report_rows():
    from minimax_hotfix.registry.status_table import status_rows

    return status_rows(list(pack_registry.all_fixes().values()))


def test_a_fix_module_that_fails_to_import_is_skipped(registry, tmp_path, caplog):
    (tmp_path / "broken_fix.py").write_text("raise ImportError('needs a newer ComfyUI')\n")
    (tmp_path / "good_fix.py").write_text(
        "from minimax_hotfix.contract import Fix, State, Status\n"
        "class Good(Fix):\n    id = 'good_fix'\n    targets = ('vae',)\n"
        "    def detect(self):\n        return Status(State.NOT_APPLICABLE, 'test')\n"
        "FIX = Good()\n"
    )
    registry.discovering(tmp_path)
    with caplog.at_level(logging.WARNING, logger="minimax_hotfix"):
        assert list(pack_registry.all_fixes()) == ["good_fix"]
    assert "needs a newer ComfyUI" in pack_registry.broken_modules()["broken_fix"]
    assert any("broken_fix failed to import" in r.getMessage() for r in caplog.records)
    from minimax_hotfix.registry.status_table import status_rows

    assert status_rows()[-1] == ("broken_fix", "failed", "module failed to import: ImportError: needs a newer ComfyUI")


def test_the_off_switch_disables_a_fix_without_detecting_it(monkeypatch, registry):
    good, bad = registry(CountingFix(), RaisingDetectFix())
    monkeypatch.setenv(pack_registry.DISABLE_ENV, f"{bad.id}, {good.id}")
    assert pack_registry.status(good) == pack_registry.status(bad) == Status(State.DISABLED, f"switched off by {pack_registry.DISABLE_ENV}")
    assert pack_registry.attach_fixes(StandInBackend().patcher(tiny_model()), "model") == []
    monkeypatch.setenv(pack_registry.DISABLE_ENV, "all")
    assert pack_registry.status(good).state is State.DISABLED
    monkeypatch.delenv(pack_registry.DISABLE_ENV)
    assert pack_registry.status(good).state is State.NEEDED


@pytest.mark.parametrize("switch", ["ALL", "All", "TEST_COUNTING", " Test_Counting "])
def test_the_off_switch_ignores_case(monkeypatch, registry, switch):
    (fix,) = registry(CountingFix())
    monkeypatch.setenv(pack_registry.DISABLE_ENV, switch)
    assert pack_registry.status(fix).state is State.DISABLED
    # Red control: one letter more, the same spelling switches nothing off (a switch that is merely set is no match).
    monkeypatch.setenv(pack_registry.DISABLE_ENV, f"{switch.strip()}x")
    assert pack_registry.status(fix).state is State.NEEDED


def test_an_unknown_id_in_the_off_switch_is_logged_once_with_the_known_ids(monkeypatch, registry, caplog):
    (fix,) = registry(CountingFix())
    monkeypatch.setenv(pack_registry.DISABLE_ENV, "test_countin, all_fixes")
    with caplog.at_level(logging.WARNING, logger="minimax_hotfix"):
        for _ in range(3):
            # Red control: the typo switches nothing off, so without the warning nothing would tell.
            assert pack_registry.status(fix).state is State.NEEDED
    assert [r.getMessage() for r in caplog.records] == [
        f"MiniMax Hotfix: {pack_registry.DISABLE_ENV} names no known fix: all_fixes, test_countin "
        f"(known ids: {fix.id}, or all)"
    ]


class ProvisionalFix(CountingFix):
    """Can only tell on first use (as the transformers shim): provisional until then."""

    id = "test_provisional"

    def __init__(self):
        super().__init__()
        self.verdict = None
        self.detections = 0

    def detect(self):
        self.detections += 1
        return self.verdict or Status(State.NEEDED, "guard installed", provisional=True)


def test_a_provisional_status_is_asked_again_until_final(registry, caplog):
    (fix,) = registry(ProvisionalFix())
    with caplog.at_level(logging.INFO, logger="minimax_hotfix"):
        assert pack_registry.status(fix).reason == pack_registry.status(fix).reason == "guard installed"
        fix.verdict = Status(State.FIXED_UPSTREAM, "probed on first use")
        assert pack_registry.status(fix) == fix.verdict
        pack_registry.status(fix)
    assert fix.detections == 3  # asked while provisional, then never again
    assert [r.getMessage() for r in caplog.records] == [
        "MiniMax Hotfix: test_provisional: needed (guard installed)",
        "MiniMax Hotfix: test_provisional: fixed upstream (probed on first use)",
    ]


def test_each_fix_module_is_named_by_its_fix_id_and_the_start_up_list_names_the_process_wide_ones():
    """The registry finds ids and the process-wide fixes without importing fix modules, so both must agree with the
    modules. Red control: a fix whose module name and id differ would be unknown to the off switch until imported."""
    fixes = pack_registry.all_fixes()
    assert sorted(fixes) == pack_registry.fix_module_names()
    assert all(type(fix).__module__ == f"{patches.__name__}.{fix.id}" for fix in fixes.values())
    process_wide = sorted(fix.id for fix in fixes.values() if "process" in fix.targets)
    assert process_wide == sorted(patches.PROCESS_WIDE)
