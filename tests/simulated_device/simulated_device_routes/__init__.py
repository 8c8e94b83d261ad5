"""Test-only ComfyUI custom node: the simulated accelerator's settings and counters over HTTP, for a test that drives
a server running on it (``tests/comfyui_server.py``).

* ``GET /simulated_device``: totals, allocated bytes per device, ``_int_mm`` availability, host-to-device copies.
* ``POST /simulated_device`` ``{"total_mb": float, "int_mm": bool, "reset_counters": bool}`` (each optional).
"""

from aiohttp import web

import server
import simulated_accelerator


@server.PromptServer.instance.routes.get("/simulated_device")
async def simulated_device_stats(request):
    return web.json_response(simulated_accelerator.stats())


@server.PromptServer.instance.routes.post("/simulated_device")
async def simulated_device_settings(request):
    body = await request.json()
    if "total_mb" in body:
        simulated_accelerator.set_total_mb(float(body["total_mb"]))
    if "int_mm" in body:
        simulated_accelerator.set_int_mm(bool(body["int_mm"]))
    if body.get("reset_counters"):
        simulated_accelerator.reset_counters()
    return web.json_response(simulated_accelerator.stats())


NODE_CLASS_MAPPINGS = {}
