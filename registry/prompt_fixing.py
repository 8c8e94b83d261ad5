"""Fixing every prompt on the server: the swap (``swap_loaders.py``) run on each queued prompt in API format, as an
explicit choice, so API clients, serverless workers and shared servers get the fixes without editing their workflows.

The switch, read per prompt:
* ``MINIMAX_HOTFIX_FIX_EVERY_PROMPT`` (server-wide, for headless servers): ``1``/``on``/``true`` fixes every prompt,
  ``0``/``off``/``false`` none, whatever a user's setting says;
* unset: the setting ``MiniMaxHotfix.FixEveryRun`` of the user who queued the prompt (ComfyUI keeps settings per user
  on the server; ``nodes/prompt_fixing.py`` reads them from the request). Off by default.

What a fixed prompt gets is exactly the browser's *Fix this workflow*: stock loaders become the pack's, an Apply node
goes after every other MODEL / CLIP / VAE source named in ``swap_loaders.API_LOADER_OUTPUTS``. Nothing else in the
body changes (``extra_data``, with the saved workflow, stays the user's own); a prompt already going through the pack
is left as it is; a prompt the swap cannot read goes on unchanged, for ComfyUI's own validation to answer.

This module knows no aiohttp and no ComfyUI: ``nodes/prompt_fixing.py`` registers it with the server.
"""

from __future__ import annotations

import collections
import os
import threading

from ..contract import State, Target, log
from . import all_fixes, status

FIX_EVERY_PROMPT_ENV = "MINIMAX_HOTFIX_FIX_EVERY_PROMPT"
FIX_EVERY_RUN_SETTING = "MiniMaxHotfix.FixEveryRun"
SETTING_NAME = "MiniMax Hotfix: fix every run on this server"
ON, OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def server_switch() -> bool | None:
    """The server-wide switch: True or False where the environment variable sets it, None where users decide."""
    value = os.environ.get(FIX_EVERY_PROMPT_ENV, "").strip().lower()
    return True if value in ON else False if value in OFF else None


def switched_on(user_setting: bool | None) -> bool:
    """Whether a prompt queued by a user whose setting is ``user_setting`` (None: not known) is fixed."""
    server = server_switch()
    return bool(user_setting) if server is None else server


def how_to_switch_on() -> str:
    return (f"set {FIX_EVERY_PROMPT_ENV}=1 before starting ComfyUI to fix every prompt on this server (browser users: "
            f"the setting \"{SETTING_NAME}\")")


class PromptFixing:
    """The on-prompt handler's process-wide record: how many prompts it saw switched on and how many it changed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._switched_on = 0
        self._changed = 0

    def fixed_body(self, body, user_setting: bool | None, loader_outputs=None):
        """``body`` (a ``POST /prompt`` body) with its prompt fixed, a new dict; ``body`` itself where the switch is
        off, the prompt needs nothing, or the swap cannot read it. Never raises. ``loader_outputs``: what the server
        knows of each node type's outputs (``swap_loaders.swap_api``); None: the swap's own table."""
        if not switched_on(user_setting) or not isinstance(body, dict) or not isinstance(body.get("prompt"), dict):
            return body
        from .. import swap_loaders

        with self._lock:
            self._switched_on += 1
        try:
            prompt = dict(body["prompt"])  # swap_api replaces changed nodes with copies: the client's stay intact
            changes = swap_loaders.swap_api(prompt, loader_outputs)
        except swap_loaders.WorkflowError as exc:
            log.info("MiniMax Hotfix: prompt left as it is (server-side fixing cannot read it: %s)", exc)
            return body
        except Exception as exc:  # noqa: BLE001  (a prompt the swap cannot read goes to ComfyUI's own validation)
            log.info("MiniMax Hotfix: prompt left as it is (server-side fixing cannot read it: %s: %s)",
                     type(exc).__name__, exc)
            return body
        if not changes:
            return body
        with self._lock:
            self._changed += 1
        swapped = collections.Counter(f"{swap_loaders.PACK_TO_STOCK[node['class_type']]} -> {node['class_type']}"
                                      for node in changes.swapped)
        inserted = collections.Counter(f"{apply['class_type']} after {after['class_type']}"
                                       for apply, after in changes.inserted)
        log.info("MiniMax Hotfix: fixed a prompt on the server: %d loader(s) swapped, %d Apply node(s) inserted (%s)",
                 len(changes.swapped), len(changes.inserted),
                 ", ".join(f"{count} x {what}" for what, count in sorted((swapped + inserted).items())))
        for warning in changes.warnings:
            log.warning("MiniMax Hotfix: %s", warning)
        return {**body, "prompt": prompt}

    def describe(self) -> str:
        """One line for the Status node and the doctor: the switch, and what it did in this process."""
        server = server_switch()
        if server is None:
            switch = (f"per user (setting \"{SETTING_NAME}\"; {FIX_EVERY_PROMPT_ENV} unset), off unless a user turned "
                      "it on")
        else:
            switch = f"{'on' if server else 'off'} for every prompt ({FIX_EVERY_PROMPT_ENV})"
        with self._lock:
            seen, changed = self._switched_on, self._changed
        return f"{switch}; {seen} prompt(s) queued with it on, {changed} changed"


PROMPT_FIXING = PromptFixing()


def needed_model_fixes() -> list[str]:
    """The fixes that attach to models (through the pack's loaders or server-side fixing) and are needed here."""
    per_model = (Target.VAE, Target.CLIP, Target.MODEL)
    return [fix.id for fix in all_fixes().values()
            if any(target in fix.targets for target in per_model) and status(fix).state is State.NEEDED]


def startup_hint() -> None:
    """One log line at start-up: server-side fixing is on, or which fixes this machine needs and how to switch it on."""
    if server_switch():
        log.info("MiniMax Hotfix: server-side fixing is on (%s): every queued prompt goes through the pack's loaders",
                 FIX_EVERY_PROMPT_ENV)
        return
    needed = needed_model_fixes()
    if needed:
        log.info("MiniMax Hotfix: needed on this machine: %s. They reach a prompt through the pack's loaders; a "
                 "workflow with the stock loaders does not get them unless you %s", ", ".join(needed),
                 how_to_switch_on())
    for fix_id in needed:
        note = all_fixes()[fix_id].machine_note()
        if note:
            log.warning("MiniMax Hotfix: %s: %s", fix_id, note)


def failure_hint(message: str, traceback: str, through_pack: bool) -> str | None:
    """The log line for a prompt that failed with a known error (``registry/known_errors.py``), or None;
    ``through_pack``: the prompt had the pack's loaders or Apply nodes (its own, or put there by server-side fixing)."""
    from .known_errors import Remedy, known_error

    entry = known_error(message, traceback)
    if entry is None:
        return None
    line = f"MiniMax Hotfix: this prompt failed with a known bug ({entry.fix}): {entry.explanation}"
    if entry.remedy is not Remedy.LOADERS:
        return f"{line} Check its state: python tools/doctor.py --fix {entry.fix}"
    if through_pack:
        return f"{line} The prompt went through the pack: check the fix's state with python tools/doctor.py --fix " \
               f"{entry.fix}"
    return f"{line} Fix: the pack's loaders in the workflow, or {how_to_switch_on()}"
