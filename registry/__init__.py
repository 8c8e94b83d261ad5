"""Fix registry: finds every fix module in ``patches/``, decides once per process whether each is needed,
and attaches the needed ones to a model's patcher.

ComfyUI's start-up imports only the process-wide fix modules (``patches.PROCESS_WIDE``) and installs them; every
other fix module is imported when a model it may attach to is first loaded, or when the status node or the doctor
asks. A fix module's name is its fix's id, so the off switch and the public API know every id without importing.

Guarantees (each has a test in tests/test_registry.py, unless another file is named):
* attaching twice equals attaching once (fixes attach under a per-fix key that replaces, never stacks);
* detaching restores the original objects;
* only the patcher handed in is touched, so a stock loader's model in the same process is not;
* everything is patcher-level, so ComfyUI's clone() and cached_patcher_init rebuilds carry the fixes along;
* a fix whose module fails to import or whose detection raises is "failed" alone, logged once, never raised;
* no fix changes a seeded result: loading the pack, detection, attach, first-use probes, the status table and
  process-wide install leave the global random state of torch, ``random`` and NumPy as it was
  (tests/test_random_state.py).

Off switch: MINIMAX_HOTFIX_DISABLE=<id>[,<id>...] (or "all"; case-insensitive), read when a fix is looked at, so
it also works for a ComfyUI started with the variable set. Only the switch gives the state "disabled"; an id it
names that no fix has is logged once with the known ids. This module is the only place that reads the switch; a fix
learns it through the ``RegistryLink`` the registry hands it (``Fix.link``).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import threading
import weakref
from typing import NamedTuple

from .. import patches
from ..contract import PACK_KEY, Fix, RegistryLink, State, Status, Target, error_line, log

DISABLE_ENV = "MINIMAX_HOTFIX_DISABLE"

_lock = threading.RLock()  # the registry's own state below
# Attaching, detaching, installing and uninstalling, one at a time: each is detach-then-attach (or install-then-record),
# which two threads interleaved would stack or misrecord. Taken before any fix's own lock, never while holding _lock.
_changing = threading.RLock()
_fixes: dict[str, Fix] | None = None  # every fix, once all_fixes() has imported them all
_loaded: dict[str, Fix] = {}  # the fixes imported so far, by module name (= fix id)
_detected: dict[str, Status] = {}
_broken_modules: dict[str, str] = {}
_checked_ids: set[str] = set()  # off-switch ids already checked against the fixes (and logged if unknown)
_hooked: dict[str, weakref.WeakKeyDictionary] = {}  # fix id -> {model it hooked at a load (while alive): modules}
_last_hooked: dict[str, int] = {}  # fix id -> modules it hooked at its last load
_installed: set[str] = set()  # the process-wide fixes installed now


def fix_module_names() -> list[str]:
    """The fix modules in ``patches/``, found without importing them (a module's name is its fix's id)."""
    return sorted(info.name for info in pkgutil.iter_modules(patches.__path__))


def _load(name: str) -> Fix | None:
    """The ``FIX`` of module ``name``, imported once; a module that fails to import is logged once and gives None."""
    with _lock:
        if name not in _loaded and name not in _broken_modules:
            try:
                fix = importlib.import_module(f"{patches.__name__}.{name}").FIX
            except Exception as exc:  # a broken fix must never break ComfyUI start-up
                _broken_modules[name] = f"{type(exc).__name__}: {exc}"
                log.warning("MiniMax Hotfix: fix module %s failed to import and is left off: %s", name, exc)
                return None
            fix.link = link_for(fix)
            _loaded[name] = fix
        return _loaded.get(name)


def all_fixes() -> dict[str, Fix]:
    """Every fix module's ``FIX``, by id. ComfyUI's start-up imports only ``patches.PROCESS_WIDE``; the first model
    load (or the status node, the doctor) imports the rest, here."""
    global _fixes
    with _lock:
        if _fixes is None:
            _fixes = {fix.id: fix for fix in map(_load, fix_module_names()) if fix is not None}
        return _fixes


def link_for(fix: Fix) -> RegistryLink:
    """What the registry hands ``fix`` (``Fix.link``) when it imports it."""
    return RegistryLink(switched_off=lambda: switched_off(fix.id), refresh_status=lambda: status(fix),
                        hooked=lambda model, modules: _record_hooked(fix.id, model, modules))


def _record_hooked(fix_id: str, model, modules: int) -> None:
    with _lock:
        try:
            _hooked.setdefault(fix_id, weakref.WeakKeyDictionary())[model] = modules
        except TypeError:  # a model that takes no weak reference is not counted (and not kept alive)
            pass
        _last_hooked[fix_id] = modules


class Attachment(NamedTuple):
    """What a fix did in this process, as opposed to what it found (``status``): the models it hooked at a load that
    are still alive, the modules it hooked at its last load (None: no load yet), and, for a process-wide fix,
    whether it is installed (None for the others)."""

    loaded_models: int
    modules_hooked_last_load: int | None
    installed_process_wide: bool | None

    def __str__(self) -> str:
        if self.installed_process_wide is not None:
            return "installed process-wide" if self.installed_process_wide else "not installed"
        if not self.loaded_models:
            return "attached to no loaded model" + ("" if self.modules_hooked_last_load is None else
                                                    f" ({self.modules_hooked_last_load} module(s) hooked at the last "
                                                    "load, of a model since freed)")
        return (f"attached to {self.loaded_models} loaded model(s), {self.modules_hooked_last_load} module(s) hooked "
                "(last load)")


def attachment(fix: Fix) -> Attachment:
    """Where ``fix`` is attached now: a model from a stock loader, never handed to the pack, is not counted."""
    with _lock:
        return Attachment(len(_hooked.get(fix.id, ())), _last_hooked.get(fix.id),
                          fix.id in _installed if Target.PROCESS in fix.targets else None)


def fix_named(fix_id: str) -> Fix | None:
    """The fix ``fix_id`` (importing its module alone), or None where its module failed to import or does not exist."""
    if _fixes is not None:
        return _fixes.get(fix_id)
    return _load(fix_id) if fix_id in fix_module_names() else None


def broken_modules() -> dict[str, str]:
    """The fix modules that failed to import so far, with the error (``all_fixes()`` tries every module)."""
    return dict(_broken_modules)


def key_for(fix: Fix) -> str:
    return f"{PACK_KEY}.{fix.id}"


def disabled_ids() -> set[str]:
    """The ids named by the off switch, lower-cased; an unknown one is logged once with the known ids."""
    named = {part.strip().lower() for part in os.environ.get(DISABLE_ENV, "").split(",") if part.strip()}
    if not named - {"all"} - _checked_ids:  # the common case, on every wrapped call: no lock, no scan of patches/
        return named
    with _lock:  # two first looks must not both log the same unknown id
        not_yet_checked = named - {"all"} - _checked_ids
        _checked_ids.update(not_yet_checked)
    known = {fix_id.lower() for fix_id in (fix_module_names() if _fixes is None else _fixes)}
    unknown = sorted(not_yet_checked - known)
    if unknown:
        log.warning("MiniMax Hotfix: %s names no known fix: %s (known ids: %s, or all)", DISABLE_ENV,
                    ", ".join(unknown), ", ".join(sorted(known)))
    return named


def switched_off(fix_id: str) -> bool:
    named = disabled_ids()
    return fix_id.lower() in named or "all" in named


def status(fix: Fix) -> Status:
    """The fix's state for this process. Detection runs once (until final, for provisional answers); the off
    switch is checked every time."""
    if switched_off(fix.id):
        return Status(State.DISABLED, f"switched off by {DISABLE_ENV}")
    with _lock:
        known = _detected.get(fix.id)
        if known is not None and not known.provisional:
            return known
        try:
            found = fix.detect()
        except Exception as exc:
            found = Status(State.FAILED, f"detection failed ({error_line(exc)}); fix left off")
        if found != known:
            _log_status(fix, found)
        _detected[fix.id] = found
        return found


def _log_status(fix: Fix, found: Status) -> None:
    if found.state == State.FAILED:
        log.warning("MiniMax Hotfix: %s: %s", fix.id, found.reason)
    else:
        log.info("MiniMax Hotfix: %s: %s (%s)", fix.id, found.state.value, found.reason)


def fixes_for(target: Target) -> list[Fix]:
    if target == Target.PROCESS and _fixes is None:  # ComfyUI's start-up: only the process-wide modules load
        candidates = [fix for fix in map(_load, patches.PROCESS_WIDE) if fix is not None]
    else:
        candidates = all_fixes().values()
    return [fix for fix in candidates if target in fix.targets]


def attach_fixes(patcher, target: Target, own_patcher: bool = False) -> list[str]:
    """Attach every needed fix for ``target`` (VAE, CLIP or MODEL) to ``patcher``; return their ids.
    ``own_patcher``: ``patcher`` is the pack's own (``Fix.on_own_patcher``): its loader's, or an Apply node's clone."""
    attached = []
    for fix in fixes_for(target):
        if status(fix).state != State.NEEDED:
            continue
        key = key_for(fix)
        with _changing:
            if own_patcher:
                try:
                    fix.on_own_patcher(patcher)
                except Exception as exc:  # the model is loaded: its load-time choice is an improvement, never a must
                    log.warning("MiniMax Hotfix: %s left the loaded model as ComfyUI loaded it: %s", fix.id,
                                error_line(exc))
            fix.detach(patcher, key)
            fix.attach(patcher, key)
        log.info("MiniMax Hotfix: %s attached to %s (%s patcher %s)", fix.id, type(getattr(patcher, "model", None)).__name__,
                 target, type(patcher).__name__)
        attached.append(fix.id)
    return attached


def detach_fixes(patcher, target: Target) -> None:
    for fix in fixes_for(target):
        with _changing:
            fix.detach(patcher, key_for(fix))


def install_process_fixes() -> list[str]:
    """Install the needed process-wide fixes (guarded global patches); idempotent; never raises."""
    installed = []
    for fix in fixes_for(Target.PROCESS):
        if status(fix).state != State.NEEDED:
            continue
        with _changing:
            try:
                fix.install()
            except Exception as exc:
                log.warning("MiniMax Hotfix: %s failed to install and is left off: %s", fix.id, exc)
                continue
            installed.append(fix.id)
            with _lock:
                _installed.add(fix.id)
    return installed


def uninstall_process_fixes() -> None:
    for fix in fixes_for(Target.PROCESS):
        with _changing:
            fix.uninstall()
            with _lock:
                _installed.discard(fix.id)


__all__ = [
    "DISABLE_ENV", "Attachment", "all_fixes", "attachment", "attach_fixes", "broken_modules", "detach_fixes", "disabled_ids", "fix_module_names",
    "fix_named", "fixes_for", "install_process_fixes", "key_for", "status", "switched_off", "uninstall_process_fixes",
]
