"""Fix registry: finds every fix module in ``patches/``, decides once per process whether each is needed,
and attaches the needed ones to a model's patcher.

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

from .. import patches
from .contract import PACK_KEY, Fix, RegistryLink, State, Status, Target, log

DISABLE_ENV = "MINIMAX_HOTFIX_DISABLE"

_lock = threading.RLock()
_fixes: dict[str, Fix] | None = None
_detected: dict[str, Status] = {}
_broken_modules: dict[str, str] = {}
_reported_unknown_ids: set[str] = set()


def all_fixes() -> dict[str, Fix]:
    """Every fix module's ``FIX``, by id, imported once. A module that fails to import is logged and skipped."""
    global _fixes
    with _lock:
        if _fixes is None:
            found: dict[str, Fix] = {}
            for info in sorted(pkgutil.iter_modules(patches.__path__), key=lambda m: m.name):
                try:
                    fix = importlib.import_module(f"{patches.__name__}.{info.name}").FIX
                except Exception as exc:  # a broken fix must never break ComfyUI start-up
                    _broken_modules[info.name] = f"{type(exc).__name__}: {exc}"
                    log.warning("MiniMax Hotfix: fix module %s failed to import and is left off: %s", info.name, exc)
                    continue
                fix.link = _link(fix)
                found[fix.id] = fix
            _fixes = found
        return _fixes


def _link(fix: Fix) -> RegistryLink:
    return RegistryLink(switched_off=lambda: switched_off(fix.id), refresh_status=lambda: status(fix))


def fix_named(fix_id: str) -> Fix | None:
    """The fix ``fix_id``, or None where its module failed to import."""
    return all_fixes().get(fix_id)


def broken_modules() -> dict[str, str]:
    all_fixes()
    return dict(_broken_modules)


def key_for(fix: Fix) -> str:
    return f"{PACK_KEY}.{fix.id}"


def disabled_ids() -> set[str]:
    """The ids named by the off switch, lower-cased; an unknown one is logged once with the known ids."""
    named = {part.strip().lower() for part in os.environ.get(DISABLE_ENV, "").split(",") if part.strip()}
    known = {fix_id.lower() for fix_id in all_fixes()} | set(broken_modules())
    unknown = sorted(named - known - {"all"} - _reported_unknown_ids)
    if unknown:
        _reported_unknown_ids.update(unknown)
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
            found = Status(State.FAILED, f"detection failed ({type(exc).__name__}: {exc}); fix left off")
        if found != known:
            _log_status(fix, found)
        _detected[fix.id] = found
        return found


def _log_status(fix: Fix, found: Status) -> None:
    if found.state == State.FAILED:
        log.warning("MiniMax Hotfix: %s: %s", fix.id, found.reason)
    else:
        log.info("MiniMax Hotfix: %s: %s (%s)", fix.id, found.state.value, found.reason)


def forget_detection() -> None:
    """Tests only: make the next ``status`` call detect again."""
    with _lock:
        _detected.clear()


def fixes_for(target: Target) -> list[Fix]:
    return [fix for fix in all_fixes().values() if target in fix.targets]


def attach_fixes(patcher, target: Target) -> list[str]:
    """Attach every needed fix for ``target`` (VAE, CLIP or MODEL) to ``patcher``; return their ids."""
    attached = []
    for fix in fixes_for(target):
        if status(fix).state != State.APPLIED:
            continue
        key = key_for(fix)
        fix.detach(patcher, key)
        fix.attach(patcher, key)
        log.info("MiniMax Hotfix: %s attached to %s (%s patcher %s)", fix.id, type(getattr(patcher, "model", None)).__name__,
                 target, type(patcher).__name__)
        attached.append(fix.id)
    return attached


def detach_fixes(patcher, target: Target) -> None:
    for fix in fixes_for(target):
        fix.detach(patcher, key_for(fix))


def install_process_fixes() -> list[str]:
    """Install the needed process-wide fixes (guarded global patches); idempotent; never raises."""
    installed = []
    for fix in fixes_for(Target.PROCESS):
        if status(fix).state != State.APPLIED:
            continue
        try:
            fix.install()
        except Exception as exc:
            log.warning("MiniMax Hotfix: %s failed to install and is left off: %s", fix.id, exc)
            continue
        installed.append(fix.id)
    return installed


def uninstall_process_fixes() -> None:
    for fix in fixes_for(Target.PROCESS):
        fix.uninstall()


__all__ = [
    "DISABLE_ENV", "all_fixes", "attach_fixes", "broken_modules", "detach_fixes", "disabled_ids", "fix_named",
    "fixes_for", "install_process_fixes", "key_for", "status", "switched_off", "uninstall_process_fixes",
]
