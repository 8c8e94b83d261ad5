"""Concurrent calls of the public functions and of every fix's attach / detach / install / uninstall on one model or
process end as some order of the same calls made one at a time, and a detach after them leaves nothing of the pack
behind (api.py's promise; docs/architecture.md, "Adding a fix": a fix's process-wide state lives on its instance,
under its lock).

The public function's race runs ROUNDS rounds of THREADS threads released by one barrier with a tiny switch interval;
on the code before the locks it failed in most rounds. The registry's races are too narrow to show that way, so every
race is also forced: every thread is held inside the unguarded step until all are there (``everyone_inside``), which
loses in the first round on the code before the locks and, as each test's red control, with the lock taken out."""

import contextlib
import logging
import sys
import threading
import time

import pytest
import torch

from hotfix_testing.concurrency import start_together
from hotfix_testing.counting_fix import CountingFix, tiny_model
from hotfix_testing.patchers import StandInPatcher
from minimax_hotfix import registry as pack_registry
from minimax_hotfix.contract import State, Status, Target, model_injection

THREADS, ROUNDS = 4, 150
# How long a forced meeting waits for every thread: a lock lets one in at a time, so the meeting times out there; long
# enough that a busy 2-core machine gets every unlocked thread to it
MEETING_S = 1.5


def pack_traces(model: torch.nn.Module) -> list:
    """Every hook and instance attribute on ``model``'s modules: what an attach adds and a detach must take away."""
    return [(name, len(m._forward_pre_hooks), len(m._forward_hooks), len(m._forward_hooks_with_kwargs),
             sorted(k for k in vars(m) if not k.startswith("_")))
            for name, m in model.named_modules()]


class NoLock(contextlib.nullcontext):
    """The red controls' stand-in for a fix's or the registry's lock: lets every thread in."""

    def acquire(self, *args, **kwargs):
        return True

    def release(self):
        pass


@contextlib.contextmanager
def everyone_inside(module, name: str, meeting: threading.Barrier | None = None, after: bool = False):
    """Holds each call of ``module.name`` at ``meeting`` (default: until THREADS calls are inside it at once), before
    the call or ``after`` it, for at most MEETING_S (a lock lets one in at a time): the interleaving that loses when
    nothing serializes the callers."""
    meeting = meeting or threading.Barrier(THREADS, timeout=MEETING_S)
    original = getattr(module, name)

    def held(*args, **kwargs):
        if not after:
            with contextlib.suppress(threading.BrokenBarrierError):
                meeting.wait()
        result = original(*args, **kwargs)
        if after:
            with contextlib.suppress(threading.BrokenBarrierError):
                meeting.wait()
            time.sleep(0.05)  # the other side's bookkeeping goes first
        return result

    setattr(module, name, held)
    try:
        yield
    finally:
        setattr(module, name, original)


# --- api.attach_to_transformers_model / detach_from_transformers_model ------------------------------------------------



@pytest.fixture
def tower_model():
    pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
    from minimax_hotfix.diagnostics.self_tests.transformers_qwen3vl_pos_embed import tiny_tower

    model = torch.nn.Module()
    model.visual = tiny_tower()
    return model


def attach_race_rounds(model, rounds: int, racing=contextlib.nullcontext) -> list[str]:
    """What went wrong in ``rounds`` rounds of THREADS concurrent attaches (inside ``racing()``) then one detach."""
    from minimax_hotfix import api

    stock = pack_traces(model)
    api.attach_to_transformers_model(model)
    attached_once = pack_traces(model)
    api.detach_from_transformers_model(model)
    wrong = []
    for round_ in range(rounds):
        with racing():
            errors = start_together([lambda: api.attach_to_transformers_model(model)] * THREADS)
        if pack_traces(model) != attached_once:
            wrong.append(f"round {round_}: {THREADS} attaches left more than one attach's hooks")
        api.detach_from_transformers_model(model)
        if pack_traces(model) != stock:
            wrong.append(f"round {round_}: the detach left the pack behind")
            api.detach_from_transformers_model(model)
            for module in model.modules():  # start the next round from the stock tower
                module._forward_hooks.clear(), module._forward_pre_hooks.clear()
                module._forward_hooks_with_kwargs.clear()
                vars(module).pop("forward", None), vars(module).pop("fast_pos_embed_interpolate", None)
                vars(module).pop("rot_pos_emb", None)
        wrong += errors
    return wrong


@pytest.mark.usefixtures("fresh_detection")
@pytest.mark.transformers("latest", "5.8.0")
def test_concurrent_attaches_then_a_detach_leave_nothing(tower_model):
    assert attach_race_rounds(tower_model, ROUNDS) == []


@pytest.mark.usefixtures("fresh_detection")
@pytest.mark.transformers("latest", "5.8.0")
@pytest.mark.parametrize("lock", ["the fix's lock", "red control: no lock"])
def test_attaches_all_inside_the_fix_at_once(tower_model, monkeypatch, lock):
    from minimax_hotfix import api

    # the fix the public function reaches (another test's registry may have imported its module afresh)
    fix = pack_registry.fix_named(api.TRANSFORMERS_QWEN3VL_POS_EMBED)
    if lock != "the fix's lock":
        monkeypatch.setattr(fix, "_lock", NoLock())
    wrong = attach_race_rounds(tower_model, 1, lambda: everyone_inside(sys.modules[type(fix).__module__], "hook_tower"))
    if lock == "the fix's lock":
        assert wrong == []
    else:
        assert any("detach left the pack behind" in line for line in wrong), wrong


# --- registry.attach_fixes / detach_fixes on one patcher -----------------------------------------------------------------


def registry_attach_rounds(patcher, rounds: int, racing=contextlib.nullcontext) -> list[str]:
    stock = pack_traces(patcher.model)
    wrong = []
    for round_ in range(rounds):
        with racing():
            errors = start_together([lambda: pack_registry.attach_fixes(patcher, "model")] * THREADS)
        patcher.inject_model()
        hooks = sum(len(m._forward_pre_hooks) for m in patcher.model.modules())
        if hooks != 2:  # one pre-hook on each of the two Linear layers: one attach's worth
            wrong.append(f"round {round_}: {hooks} pre-hooks after {THREADS} attaches (one attach gives 2)")
        patcher.eject_model()
        pack_registry.detach_fixes(patcher, "model")
        patcher.inject_model()
        if pack_traces(patcher.model) != stock:
            wrong.append(f"round {round_}: the detach left the pack behind")
        patcher.eject_model()
        wrong += errors
    return wrong


def stacking_fix():
    """CountingFix attached the way ComfyUI's keyed callbacks and wrappers attach (``add_wrapper_with_key`` appends):
    a second attach under the same key adds to the first, so only detach-then-attach under one lock keeps it to one."""

    class Stacking(CountingFix):
        def attach(self, patcher, key):
            patcher.injections.setdefault(key, []).append(model_injection(self.hook_loaded_model, self))

    return Stacking()


@pytest.mark.parametrize("lock", ["the registry's lock", "red control: no lock"])
def test_registry_attaches_all_inside_at_once(registry, monkeypatch, lock):
    (fix,) = registry(stacking_fix())
    if lock != "the registry's lock":
        monkeypatch.setattr(pack_registry, "_changing", NoLock())
    wrong = registry_attach_rounds(StandInPatcher(tiny_model()), 1, lambda: everyone_inside(fix, "attach"))
    if lock == "the registry's lock":
        assert wrong == []
    else:
        assert any("pre-hooks after" in line for line in wrong), wrong


# --- registry.install_process_fixes / uninstall_process_fixes ---------------------------------------------------------


class ProcessFix(CountingFix):
    """A process-wide fix whose installed state the test can see."""

    id = "test_process"
    targets = (Target.PROCESS,)

    def __init__(self):
        super().__init__()
        self.installed = False

    def detect(self):
        return Status(State.NEEDED, "test fix")

    def install(self):
        self.installed = True

    def uninstall(self):
        self.installed = False


@pytest.mark.parametrize("lock", ["the registry's lock", "red control: no lock"])
def test_installs_and_uninstalls_all_inside_at_once(registry, monkeypatch, lock):
    (fix,) = registry(ProcessFix())
    if lock != "the registry's lock":
        monkeypatch.setattr(pack_registry, "_changing", NoLock())
    wrong = []
    for round_ in range(1):
        # the uninstall waits until an install has installed, then uninstalls and records it while that install
        # has yet to record its own: unlocked, the registry ends saying "installed" of an uninstalled fix
        meeting = threading.Barrier(2, timeout=MEETING_S)
        with everyone_inside(fix, "install", meeting, after=True), everyone_inside(fix, "uninstall", meeting):
            start_together([pack_registry.install_process_fixes, pack_registry.uninstall_process_fixes])
        said = pack_registry.attachment(fix).installed_process_wide
        if said != fix.installed:
            wrong.append(f"round {round_}: registry says {said}, fix is {fix.installed}")
        pack_registry.uninstall_process_fixes()
    if lock == "the registry's lock":
        assert wrong == []
    else:
        assert wrong


# --- registry.disabled_ids: an unknown id in the off switch is logged once --------------------------------------------


class MeetingSet(set):
    """``_checked_ids`` whose ``update`` holds THREADS callers until all are there (MEETING_S at most)."""

    meeting = None

    def update(self, *others):
        with contextlib.suppress(threading.BrokenBarrierError):
            self.meeting.wait()
        super().update(*others)


@pytest.mark.parametrize("lock", ["the registry's lock", "red control: no lock"])
def test_first_looks_at_the_off_switch_all_at_once_log_an_unknown_id_once(registry, monkeypatch, caplog, lock):
    registry(CountingFix())
    monkeypatch.setenv(pack_registry.DISABLE_ENV, "no_such_fix")
    if lock != "the registry's lock":
        monkeypatch.setattr(pack_registry, "_lock", NoLock())
    with caplog.at_level(logging.WARNING, logger="minimax_hotfix"):
        checked = MeetingSet()
        checked.meeting = threading.Barrier(THREADS, timeout=MEETING_S)
        monkeypatch.setattr(pack_registry, "_checked_ids", checked)
        start_together([pack_registry.disabled_ids] * THREADS)
    logged = len([r for r in caplog.records if "names no known fix" in r.getMessage()])
    assert logged == 1 if lock == "the registry's lock" else logged > 1
