"""``POST /minimax_hotfix/swap``: the swap tool (tools/swap_loaders.py) for the pack's frontend extension (web/), so
the browser and the command line run one implementation. Body: ``{"workflow": <UI format>, "reverse": bool,
"only": {"graph": subgraph id or null, "node": id} | null}``; reply: ``{"workflow", "changed", "summary",
"warnings", "kept"}``, or ``{"error"}`` with status 400 for any request the route cannot serve.

Bounds: ComfyUI's own server refuses a body over ``--max-upload-size`` (100 MB by default; aiohttp's
``client_max_size``) with 413 before the route reads it. The route bounds the rest itself: a body over
``MAX_BODY_BYTES``, not UTF-8, not JSON, nested deeper than the tool's ``MAX_DEPTH``, not an object, fields of the
wrong type, and every workflow the tool's ``validate`` refuses get 400. The route keeps no state and touches none of
ComfyUI's: the workflow is the request's own copy.
"""

import functools
import importlib.util
import sys
from pathlib import Path

from ..registry.contract import log

TOOL = Path(__file__).resolve().parents[1] / "tools" / "swap_loaders.py"
ROUTE = "/minimax_hotfix/swap"
MAX_BODY_BYTES = 32 * 1024 * 1024  # the largest official template is under 1 MB
FIELDS = ("workflow", "reverse", "only")


@functools.cache
def _load_tool():
    """The swap tool, loaded on the first request: ComfyUI's start-up does not pay for it."""
    spec = importlib.util.spec_from_file_location("minimax_hotfix_swap_loaders", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the file runs
    spec.loader.exec_module(module)
    return module


async def _read_body(request, tool) -> dict:
    """The request's JSON object; WorkflowError (400) for a body too large, not UTF-8, not JSON or not an object."""
    too_large = tool.WorkflowError(f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
    if (request.content_length or 0) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise tool.WorkflowError(f"the request body is not UTF-8 text (byte {exc.start})") from None
    try:
        body = tool.parse_json(text, allow_nan=False)
    except tool.WorkflowError as exc:
        raise tool.WorkflowError(f"the request body: {exc}") from None
    if not isinstance(body, dict):
        raise tool.WorkflowError(f"the request body is {tool.json_type_name(body)}, expected an object with "
                                 f"\"workflow\" (and \"reverse\", \"only\")")
    return body


def _swap(body: dict, tool):
    """(workflow, reverse, changes) for a request body; WorkflowError (400) for anything the swap cannot serve."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise tool.WorkflowError(f"unknown field \"{unknown[0]}\"; the fields are {', '.join(FIELDS)}")
    reverse = body.get("reverse", False)
    if not isinstance(reverse, bool):
        raise tool.WorkflowError(f"\"reverse\" is {tool.json_type_name(reverse)}, expected true or false")
    if "workflow" not in body:
        raise tool.WorkflowError("\"workflow\" is missing, expected a UI-format workflow")
    workflow = body["workflow"]
    if tool.workflow_format(workflow) != "ui":
        raise tool.WorkflowError("\"workflow\" is an API-format workflow, expected a UI-format workflow (what "
                                 "ComfyUI's frontend saves)")
    return workflow, reverse, tool.swap(workflow, reverse=reverse, only=body.get("only"))


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
            workflow, reverse, changes = _swap(await _read_body(request, tool), tool)
        except tool.WorkflowError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        kept = [f"node {node.get('id')} ({node.get('type')})" for node in changes.kept]
        return web.json_response({"workflow": workflow, "changed": bool(changes), "summary": changes.summary(reverse),
                                  "warnings": changes.warnings, "kept": kept})
