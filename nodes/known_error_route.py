"""``POST /minimax_hotfix/known_error``: whether a failed prompt's error is one the pack's fixes repair, for the
frontend extension (web/minimax_hotfix.js), which posts ComfyUI's ``execution_error`` event and the prompt it ran.
Body: ``{"error": {"node_id", "node_type", "exception_message", "traceback"}, "prompt": <API format>}``; reply:
``{"known": false}``, or ``{"known": true, ...}`` with what ``registry.known_errors.explain`` says. The errors
themselves are ``registry.known_errors.KNOWN_ERRORS``, loaded with the first request, not at ComfyUI's start-up.
"""

import asyncio

from ..contract import log

ROUTE = "/minimax_hotfix/known_error"


def _explain(body: dict):
    from .. import swap_loaders
    from ..registry.known_errors import explain
    from .node_types import output_types

    error, prompt = body.get("error"), body.get("prompt")
    if not isinstance(error, dict) or not isinstance(prompt, dict):
        return None
    prompt = {key: node for key, node in prompt.items()
              if isinstance(node, dict) and isinstance(node.get("class_type"), str)}
    return explain(error, prompt, output_types, swap_loaders.STOCK_TO_PACK,
                   {io_type: apply_type for io_type, (apply_type, _) in swap_loaders.APPLY_NODE.items()})


def register_known_error_route() -> None:
    """Adds the route to ComfyUI's server; logs and goes on where the server is not there (never breaks start-up)."""
    try:
        from aiohttp import web
        from server import PromptServer

        routes = PromptServer.instance.routes
    except Exception as exc:  # noqa: BLE001  (a missing route only disables the known-error notices)
        log.warning("MiniMax Hotfix: known-error notices unavailable: %s", exc)
        return

    @routes.post(ROUTE)
    async def known_error(request):
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the request body is not JSON"}, status=400)
        # a fix's first status detects it, which may take a moment: off the server's event loop
        said = await asyncio.to_thread(_explain, body) if isinstance(body, dict) else None
        return web.json_response({"known": said is not None, **(said or {})})
