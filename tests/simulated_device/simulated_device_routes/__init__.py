"""Test-only ComfyUI custom node: the simulated accelerator's settings and counters over HTTP, for a test that drives
a server running on it (``tests/hotfix_testing/comfyui_server.py``).

* ``GET /simulated_device``: totals, allocated bytes per device, ``_int_mm`` availability, host-to-device copies;
  ``dynamic_vram``: the stand-in comfy-aimdo's budget, resident bytes and faults (None under the legacy loader).
* ``POST /simulated_device`` ``{"total_mb": float, "int_mm": bool, "current_device": int, "reset_counters": bool,
  "vbar_mb": float}`` (each optional; ``vbar_mb``: the weights dynamic VRAM may keep resident).
"""

import sys

import server
import simulated_accelerator
from aiohttp import web


def stand_in_vbars():
    """The stand-in comfy-aimdo's ``model_vbar`` when this server runs it (tests/simulated_device/dynamic_vram)."""
    module = sys.modules.get("comfy_aimdo.model_vbar")
    return module if hasattr(module, "set_budget") else None


def stats() -> dict:
    vbars = stand_in_vbars()
    return {**simulated_accelerator.stats(), "dynamic_vram": vbars.stats() if vbars else None}


@server.PromptServer.instance.routes.get("/simulated_device")
async def simulated_device_stats(request):
    return web.json_response(stats())


@server.PromptServer.instance.routes.post("/simulated_device")
async def simulated_device_settings(request):
    body = await request.json()
    if "total_mb" in body:
        simulated_accelerator.set_total_mb(float(body["total_mb"]))
    if "int_mm" in body:
        simulated_accelerator.set_int_mm(bool(body["int_mm"]))
    if "current_device" in body:
        simulated_accelerator.set_current_device(int(body["current_device"]))
    vbars = stand_in_vbars()
    if "vbar_mb" in body and vbars:
        vbars.set_budget(body["vbar_mb"])
    if body.get("reset_counters"):
        simulated_accelerator.reset_counters()
        if vbars:
            vbars.reset_counters()
    return web.json_response(stats())


NODE_CLASS_MAPPINGS = {}
