"""``POST /minimax_hotfix/swap``: the swap tool (tools/swap_loaders.py) for the pack's frontend extension (web/), so
the browser and the command line run one implementation. Body: ``{"workflow": <UI format>, "reverse": bool,
"only": {"graph": subgraph id or null, "node": id} | null}``; reply: ``{"workflow", "changed", "summary",
"warnings", "kept"}``, or ``{"error"}`` with status 400."""

import functools
import importlib.util
import sys
from pathlib import Path

from ..registry.contract import log

TOOL = Path(__file__).resolve().parents[1] / "tools" / "swap_loaders.py"
ROUTE = "/minimax_hotfix/swap"


@functools.cache
def _load_tool():
    """The swap tool, loaded on the first request: ComfyUI's start-up does not pay for it."""
    spec = importlib.util.spec_from_file_location("minimax_hotfix_swap_loaders", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the file runs
    spec.loader.exec_module(module)
    return module


def register_swap_route() -> None:
    """Adds the route to ComfyUI's server; logs and goes on where the server is not there (never breaks start-up)."""
    try:
        from aiohttp import web
        from server import PromptServer

        routes = PromptServer.instance.routes
    except Exception as exc:  # noqa: BLE001  (a missing route only disables the browser swap)
        log.warning("MiniMax Hotfix: browser swap unavailable: %s", exc)
        return

    @routes.post(ROUTE)
    async def swap(request):
        tool = _load_tool()
        try:
            body = await request.json()
            reverse = bool(body.get("reverse"))
            workflow = body.get("workflow")
            if tool.workflow_format(workflow) != "ui":
                raise tool.WorkflowError("expected a UI-format workflow")
            changes = tool.swap(workflow, reverse=reverse, only=body.get("only"))
        except (ValueError, tool.WorkflowError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        kept = [f"node {node.get('id')} ({node.get('type')})" for node in changes.kept]
        return web.json_response({"workflow": workflow, "changed": bool(changes), "summary": changes.summary(reverse),
                                  "warnings": changes.warnings, "kept": kept})
