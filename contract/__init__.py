"""The contract every fix in ``patches/`` implements, and the per-model hook plumbing they share.

A fix module defines one ``FIX = SomeFix()``. The registry (``registry/``) finds it, asks it once whether the running
code still has the bug (``detect``), attaches it to a model's patcher on request (``attach``) or installs it
process-wide (``install``). Its self-test lives apart, in ``diagnostics/self_tests/<id>.py``, and only the doctor and
the tests import it. Nothing here imports ComfyUI: fixes reach ComfyUI objects only through the patcher they are
handed (or ``contract/comfy.py``). This package imports nothing of the pack: the fixes, the registry, the nodes and
the diagnostics all stand on it, and it knows none of them (the registry talks to a fix through ``RegistryLink``).
Beside it: ``comfy.py`` (reaching ComfyUI's modules where present) and ``on_import.py`` (patching a module the
moment it is imported).
"""

from __future__ import annotations

import enum
import importlib.metadata
import logging
import re
import types
import weakref
from typing import Callable, NamedTuple

PACK_KEY = "minimax_hotfix"

log = logging.getLogger("minimax_hotfix")


class State(str, enum.Enum):
    """What ``detect`` found about the running code, before anything is attached: ``NEEDED``: the bug is there, so the
    fix attaches to the models the pack's loaders and Apply nodes hand it (whether it did is the registry's
    ``attachment``); ``FAILED``: the fix turned itself off because its import, its detection or its target code broke
    (the reason says which); ``DISABLED``: only the user's off switch, MINIMAX_HOTFIX_DISABLE."""

    NEEDED = "needed"
    FIXED_UPSTREAM = "fixed upstream"
    NOT_APPLICABLE = "not applicable"
    NOT_AFFECTED = "not affected"
    FAILED = "failed"
    DISABLED = "disabled"


class Target(str, enum.Enum):
    """What a fix attaches to: the patcher of a VAE, a CLIP or a MODEL (per model, via ``attach``), or the process
    (a guarded global patch, via ``install``/``uninstall``)."""

    VAE = "vae"
    CLIP = "clip"
    MODEL = "model"
    PROCESS = "process"

    def __str__(self) -> str:
        return self.value


class Status(NamedTuple):
    """``provisional``: the fix can only tell for sure later (e.g. on first use); the registry asks again."""

    state: State
    reason: str
    provisional: bool = False


class Check(NamedTuple):
    """One self-test step. ``red`` steps pass when the bug reproduces with the fix off."""

    name: str
    passed: bool
    detail: str = ""


class Retirement(NamedTuple):
    """When the fix goes: ``fixed_by`` names the upstream change that makes it obsolete (or says none is known yet);
    ``delete_when`` is the condition under which its file can be deleted."""

    fixed_by: str
    delete_when: str


class RegistryLink(NamedTuple):
    """What the registry hands each fix it finds (``Fix.link``), so that code a fix runs long after install (a wrapper
    called on first use) can honour the off switch and report a new status without importing the registry:
    ``switched_off()`` reads the user's off switch now; ``refresh_status()`` makes the registry ask ``detect`` again
    and log the answer if it changed; ``hooked(model, modules)`` tells it the fix changed ``modules`` modules of
    ``model`` (at a load), which the Status node shows per fix."""

    switched_off: Callable[[], bool] = lambda: False
    refresh_status: Callable[[], object] = lambda: None
    hooked: Callable[[object, int], None] = lambda model, modules: None


class Fix:
    """Base class. Subclasses set the class attributes and implement ``detect``, then either ``hook_loaded_model``
    (per-model fixes: the default ``attach`` runs it after each load of a patcher's model) or ``install``/``uninstall``
    (``Target.PROCESS`` fixes)."""

    id: str = ""
    targets: tuple[Target, ...] = ()
    retirement: Retirement = Retirement("unknown", "unknown")
    link: RegistryLink = RegistryLink()

    def detect(self) -> Status:
        raise NotImplementedError

    def hook_loaded_model(self, model) -> list:
        """Patch one loaded model (hooks, instance attributes); return handles whose ``.remove()`` undoes each."""
        return []

    def attach(self, patcher, key: str) -> None:
        """Attach to one patcher under ``key``, replacing what the same key attached before: by default an injection
        that runs ``hook_loaded_model`` after each load and undoes it on eject."""
        set_injection(patcher, key, model_injection(self.hook_loaded_model, self))

    def detach(self, patcher, key: str) -> None:
        """Undo ``attach``. The default covers fixes that attach only injections; others override it."""
        set_injection(patcher, key, None)

    def on_own_patcher(self, patcher) -> None:
        """``patcher`` is the pack's own, before ``attach``: its loader's, or the clone an Apply node made (never the
        patcher another node loaded and caches). A fix may set on it what the stock loader leaves to ComfyUI's
        defaults (a compute dtype that is safe now). Per-model fixes only."""

    def machine_note(self) -> str | None:
        """One line about this machine for the start-up log, where what the fix repairs depends on the machine and
        not only on the core (None: nothing to say)."""
        return None

    def machine_lines(self) -> list[str]:
        """What the fix does on this machine now, for the Status node and the doctor (the start-up line's facts,
        and what it did in the last run); empty: nothing to say."""
        return []

    def install(self) -> None:
        """Process-wide fixes only: install idempotently."""

    def uninstall(self) -> None:
        """Process-wide fixes only: restore the original objects."""


def error_line(exc: BaseException) -> str:
    """``exc`` as one line for a status reason: its type and the first line of its message (a dispatcher error
    lists every backend over dozens of lines)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def package_version(distribution: str) -> str:
    """The installed version of ``distribution`` from its metadata (no import), or "not installed". The version line
    is read alone: ``importlib.metadata.version`` parses the whole file, over a millisecond of ComfyUI's start-up."""
    try:
        found = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    version = re.search(r"^Version:\s*(\S+)", found.read_text("METADATA") or "", re.MULTILINE)
    return version.group(1) if version else found.version


class AttributeOverride:
    """Sets ``obj.name = value`` and can put back exactly what was there, including 'nothing in the instance dict'."""

    _MISSING = object()

    def __init__(self, obj, name: str, value):
        self.obj, self.name = obj, name
        self.previous = vars(obj).get(name, self._MISSING) if hasattr(obj, "__dict__") else self._MISSING
        setattr(obj, name, value)

    def remove(self) -> None:
        if self.previous is self._MISSING:
            try:
                delattr(self.obj, self.name)
            except AttributeError:
                pass
        else:
            setattr(self.obj, self.name, self.previous)


def remove_handles(handles) -> None:
    """Remove ``handles`` newest first, so attribute overrides stacked on one name restore the original."""
    for handle in reversed(handles):
        handle.remove()


def model_injection(hook_loaded_model: Callable[[object], list], fix: Fix):
    """A ComfyUI ``PatcherInjection`` that runs ``hook_loaded_model(patcher.model)`` after each load and undoes it on
    eject.

    ``hook_loaded_model`` returns handles with ``.remove()`` (torch hook handles, ``AttributeOverride``). Injecting a
    model that is already injected is a no-op, so repeated loads never stack hooks. Each hooking is logged with its
    hook count and reported to the registry (``fix.link.hooked``), so a user's log and the Status node show whether
    a fix found anything to repair in the loaded model.
    """
    handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def inject(patcher) -> None:
        model = patcher.model
        if model not in handles:
            handles[model] = list(hook_loaded_model(model))
            modules = hooked_modules(handles[model])
            log.info("MiniMax Hotfix: %s hooked %d module(s) of %s (%d hook(s))", fix.id, modules,
                     type(model).__name__, len(handles[model]))
            fix.link.hooked(model, modules)

    def eject(patcher) -> None:
        remove_handles(handles.pop(patcher.model, []))

    try:
        from comfy.patcher_extension import PatcherInjection
    except ImportError:
        return types.SimpleNamespace(inject=inject, eject=eject)
    return PatcherInjection(inject=inject, eject=eject)


def hooked_modules(handles: list) -> int:
    """Distinct objects an install changed; a torch hook handle counts as one, as it names no module."""
    return len({id(getattr(handle, "obj", handle)) for handle in handles})


def set_injection(patcher, key: str, injection) -> None:
    """Put ``injection`` (or nothing) under ``key``, keeping a patcher that is injected right now consistent:
    the old injection is ejected before it is dropped and the new one injected at once, as a load would."""
    injected = getattr(patcher, "is_injected", False)
    for old in patcher.get_injections(key) or []:
        if injected:
            old.eject(patcher)
    patcher.remove_injections(key)
    if injection is not None:
        patcher.set_injections(key, [injection])
        if injected:
            injection.inject(patcher)
