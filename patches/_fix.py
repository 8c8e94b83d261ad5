"""The contract every fix in ``patches/`` implements, and the per-model hook plumbing they share.

A fix module defines one ``FIX = SomeFix()``. The registry (``patches/__init__.py``) finds it, asks it once
whether the running code still has the bug (``detect``), attaches it to a model's patcher on request
(``attach``), and runs its ``self_test`` for the doctor. Nothing here imports ComfyUI: fixes reach ComfyUI
objects only through the patcher they are handed.
"""

from __future__ import annotations

import enum
import types
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

PACK_KEY = "minimax_hotfix"


class State(str, enum.Enum):
    """``FAILED``: the fix turned itself off because its import, its detection or its target code broke (the reason
    says which); ``DISABLED``: only the user's off switch, MINIMAX_HOTFIX_DISABLE."""

    APPLIED = "applied"
    FIXED_UPSTREAM = "fixed upstream"
    NOT_APPLICABLE = "not applicable"
    NOT_AFFECTED = "not affected"
    FAILED = "failed"
    DISABLED = "disabled"


@dataclass(frozen=True)
class Status:
    """``provisional``: the fix can only tell for sure later (e.g. on first use); the registry asks again."""

    state: State
    reason: str
    provisional: bool = False


@dataclass(frozen=True)
class Check:
    """One self-test step. ``red`` steps pass when the bug reproduces with the fix off."""

    name: str
    passed: bool
    detail: str = ""


class Fix:
    """Base class. Subclasses set the class attributes and implement ``detect``.

    ``targets`` names the objects the fix attaches to: ``"vae"``, ``"clip"``, ``"model"`` (per-model, via
    ``attach``) or ``"process"`` (a guarded global patch, via ``install``/``uninstall``).
    """

    id: str = ""
    title: str = ""
    targets: tuple[str, ...] = ()
    upstream: str = ""

    def detect(self) -> Status:
        raise NotImplementedError

    def attach(self, patcher, key: str) -> None:
        """Attach to one patcher under ``key``. Must replace, never stack, what the same key attached before."""

    def detach(self, patcher, key: str) -> None:
        """Undo ``attach``. The default covers fixes that attach only injections; others override it."""
        set_injection(patcher, key, None)

    def install(self) -> None:
        """Process-wide fixes only: install idempotently."""

    def uninstall(self) -> None:
        """Process-wide fixes only: restore the original objects."""

    def self_test(self) -> Iterable[Check]:
        return ()


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


def model_injection(install: Callable[[object], list]):
    """A ComfyUI ``PatcherInjection`` that runs ``install(patcher.model)`` after each load and undoes it on eject.

    ``install`` returns handles with ``.remove()`` (torch hook handles, ``AttributeOverride``). Injecting a model
    that is already injected is a no-op, so repeated loads never stack hooks.
    """
    handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def inject(patcher) -> None:
        model = patcher.model
        if model not in handles:
            handles[model] = list(install(model))

    def eject(patcher) -> None:
        for handle in reversed(handles.pop(patcher.model, [])):
            handle.remove()

    try:
        from comfy.patcher_extension import PatcherInjection
    except ImportError:
        return types.SimpleNamespace(inject=inject, eject=eject)
    return PatcherInjection(inject=inject, eject=eject)


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
