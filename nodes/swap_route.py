"""``POST /minimax_hotfix/swap``: the pack's swap (``swap_loaders.py``, imported on the first request) for its
frontend extension (web/), so the browser and the command line (tools/swap_loaders.py) run one implementation. Body:
``{"workflow": <UI format>, "reverse": bool, "only": {"graph": subgraph id or null, "node": id} | null}``; reply:
``{"workflow", "changed", "summary", "warnings", "kept"}``, or ``{"error"}`` with status 400 for any request the
route cannot serve.

Bounds: ComfyUI's own server refuses a body over ``--max-upload-size`` (100 MB by default; aiohttp's
``client_max_size``) with 413 before the route reads it. The route bounds the rest itself: a body over
``MAX_BODY_BYTES``, not UTF-8, not JSON, nested deeper than the swap's ``MAX_DEPTH``, not an object, fields of the
wrong type, and every workflow the swap's ``validate`` refuses get 400. The route keeps no state and touches none of
ComfyUI's: the workflow is the request's own copy.
"""

from ..contract import log

ROUTE = "/minimax_hotfix/swap"
MAX_BODY_BYTES = 32 * 1024 * 1024  # the largest official template is under 1 MB
FIELDS = ("workflow", "reverse", "only")


async def _read_body(request) -> dict:
    """The request's JSON object; WorkflowError (400) for a body too large, not UTF-8, not JSON or not an object."""
    from .. import swap_loaders

    too_large = swap_loaders.WorkflowError(f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
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
        raise swap_loaders.WorkflowError(f"the request body is not UTF-8 text (byte {exc.start})") from None
    try:
        body = swap_loaders.parse_json(text, allow_nan=False)
    except swap_loaders.WorkflowError as exc:
        raise swap_loaders.WorkflowError(f"the request body: {exc}") from None
    if not isinstance(body, dict):
        raise swap_loaders.WorkflowError(f"the request body is {swap_loaders.json_type_name(body)}, expected an object "
                                         f"with \"workflow\" (and \"reverse\", \"only\")")
    return body


def _swap(body: dict):
    """(workflow, reverse, changes) for a request body; WorkflowError (400) for anything the swap cannot serve."""
    from .. import swap_loaders

    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise swap_loaders.WorkflowError(f"unknown field \"{unknown[0]}\"; the fields are {', '.join(FIELDS)}")
    reverse = body.get("reverse", False)
    if not isinstance(reverse, bool):
        raise swap_loaders.WorkflowError(f"\"reverse\" is {swap_loaders.json_type_name(reverse)}, expected true or "
                                         "false")
    if "workflow" not in body:
        raise swap_loaders.WorkflowError("\"workflow\" is missing, expected a UI-format workflow")
    workflow = body["workflow"]
    if swap_loaders.workflow_format(workflow) != "ui":
        raise swap_loaders.WorkflowError("\"workflow\" is an API-format workflow, expected a UI-format workflow "
                                         "(what ComfyUI's frontend saves)")
    return workflow, reverse, swap_loaders.swap(workflow, reverse=reverse, only=body.get("only"))


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
        from .. import swap_loaders  # on the first request: ComfyUI's start-up does not pay for it

        try:
            workflow, reverse, changes = _swap(await _read_body(request))
        except swap_loaders.WorkflowError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        kept = [f"node {node.get('id')} ({node.get('type')})" for node in changes.kept]
        return web.json_response({"workflow": workflow, "changed": bool(changes), "summary": changes.summary(reverse),
                                  "warnings": changes.warnings, "kept": kept})
