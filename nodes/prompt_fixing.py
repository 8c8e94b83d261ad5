"""Server-side fixing inside ComfyUI (the switch and the fixing itself: ``registry/prompt_fixing.py``).

* ``PromptServer.add_on_prompt_handler``: ComfyUI's own extension point, called with every ``POST /prompt`` body
  before it validates and queues it. The handler gets the body alone, so a middleware on the same server remembers,
  for the request being served, the queuing user's setting (``user_manager``: the ``comfy-user`` header in
  ``--multi-user`` mode, else the one "default" user); a ContextVar holds it, so two requests served at once never
  see each other's.
* At start-up (the server's ``on_startup``, after every custom node has loaded, before the first prompt can arrive):
  one log line, what this machine needs and the switch (``startup_hint``).
* A prompt that fails with a known error: one log line naming the bug, its fix and the switch. It listens to
  ComfyUI's own exception log (``!!! Exception during processing !!!`` and the traceback after it, on the prompt
  worker's thread) with a logging handler: that sees every failed prompt, API and headless ones included, and
  replaces nothing of ComfyUI's executor, which a wrapper of ``PromptExecutor`` would, on every core it changes in.

Nothing here raises into ComfyUI: a server without these hooks logs why and runs without server-side fixing.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading

from ..contract import log
from ..registry.prompt_fixing import (
    FIX_EVERY_PROMPT_ENV,
    FIX_EVERY_RUN_SETTING,
    PROMPT_FIXING,
    failure_hint,
    startup_hint,
)
from .node_types import loader_outputs

PROMPT_PATHS = ("/prompt", "/api/prompt")
REGISTERED_AS = "minimax_hotfix.prompt_fixing"  # what the handlers are known by, whichever copy of the pack added them
EXCEPTION_LINE = "!!! Exception during processing !!! "

# The setting of the user whose POST /prompt is being served (None: not known), per request.
_queuing_user_setting: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "minimax_hotfix_queuing_user_setting", default=None)


def _user_setting(server, request) -> bool | None:
    """The queuing user's ``MiniMaxHotfix.FixEveryRun``, or None where the user or their settings are unknown."""
    try:
        server.user_manager.get_request_user_id(request)  # KeyError for an unknown user, without ComfyUI's error log
        value = server.user_manager.settings.get_settings(request).get(FIX_EVERY_RUN_SETTING)
    except Exception:  # noqa: BLE001  (no setting known: the server-wide switch alone decides)
        return None
    return value if isinstance(value, bool) else None


def _running_prompt_goes_through_the_pack() -> bool:
    """Whether the prompt ComfyUI is running now has one of the pack's loaders or Apply nodes (queue items: number,
    id, prompt, ...)."""
    from server import PromptServer

    from .. import swap_loaders

    through = set(swap_loaders.PACK_TO_STOCK) | swap_loaders.APPLY_TYPES
    running = PromptServer.instance.prompt_queue.currently_running.values()
    return any(isinstance(node, dict) and node.get("class_type") in through
               for item in running for node in item[2].values())


def on_prompt(body):
    """ComfyUI's on-prompt handler."""
    return PROMPT_FIXING.fixed_body(body, _queuing_user_setting.get(), loader_outputs)


on_prompt.registered_as = REGISTERED_AS


class KnownErrorLog(logging.Handler):
    """Names a known error's fix and the switch under ComfyUI's own exception log, once per failed prompt."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self._failing = threading.local()  # per prompt worker: the exception message waiting for its traceback

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(log.name):
            return
        try:
            text = record.getMessage()
            if text.startswith(EXCEPTION_LINE):
                self._failing.message = text[len(EXCEPTION_LINE):]
                return
            message = getattr(self._failing, "message", None)
            self._failing.message = None
            if message is not None and "Traceback" in text:
                hint = failure_hint(message, text, _running_prompt_goes_through_the_pack())
                if hint:
                    log.warning("%s", hint)
        except Exception:  # noqa: BLE001  (a hint must never break ComfyUI's logging)
            self._failing.message = None


def registered(handlers) -> bool:
    """Whether one of ``handlers`` (the root logger's, the server's on-prompt handlers) is the pack's: a second load
    of the pack in one process (a second folder, a reload) must not add a second of each."""
    return any(REGISTERED_AS in (getattr(handler, "name", None), getattr(handler, "registered_as", None))
               for handler in handlers)


def register_prompt_fixing() -> None:
    """Hooks server-side fixing into ComfyUI's server, once per process; logs and goes on where it cannot (never
    breaks start-up)."""
    root = logging.getLogger()
    if not registered(root.handlers):
        known_error_log = KnownErrorLog()
        known_error_log.set_name(REGISTERED_AS)
        root.addHandler(known_error_log)
    try:
        from aiohttp import web
        from server import PromptServer

        server = PromptServer.instance
        if registered(getattr(server, "on_prompt_handlers", ())):
            return
        server.add_on_prompt_handler(on_prompt)
    except Exception as exc:  # noqa: BLE001
        log.warning("MiniMax Hotfix: server-side fixing unavailable: %s", exc)
        return

    @web.middleware
    async def remember_queuing_user(request, handler):
        if request.method != "POST" or request.path not in PROMPT_PATHS:
            return await handler(request)
        token = _queuing_user_setting.set(_user_setting(server, request))
        try:
            return await handler(request)
        finally:
            _queuing_user_setting.reset(token)

    async def hint_at_startup(app) -> None:
        try:
            await asyncio.to_thread(startup_hint)  # detects every fix: a fraction of a second, before the first prompt
        except Exception as exc:  # noqa: BLE001
            log.warning("MiniMax Hotfix: could not tell which fixes this machine needs: %s", exc)

    try:
        server.app.middlewares.append(remember_queuing_user)
        server.app.on_startup.append(hint_at_startup)
    except Exception as exc:  # noqa: BLE001  (a server already started: the environment variable still works)
        log.warning("MiniMax Hotfix: per-user server-side fixing unavailable (%s); %s still switches it on for "
                    "every prompt", exc, FIX_EVERY_PROMPT_ENV)
