"""Test-only ComfyUI custom node: the simulated accelerator's settings and counters over HTTP, for a test that drives
a server running on it (``tests/hotfix_testing/comfyui_server.py``), and the device's answers where ComfyUI asks
nothing of an Ascend device.

* ``GET /simulated_device``: totals, allocated bytes per device, ``_int_mm`` availability, host-to-device copies;
  ``dynamic_vram``: the stand-in comfy-aimdo's budget, resident bytes and faults (None under the legacy loader).
* ``POST /simulated_device`` ``{"total_mb": float, "int_mm": bool, "current_device": int, "reset_counters": bool,
  "vbar_mb": float}`` (each optional; ``vbar_mb``: the weights dynamic VRAM may keep resident).
* A device without bf16 (``simulated_accelerator.BF16_ENV``): ComfyUI's ``should_use_bf16`` answers yes for any
  Ascend NPU without asking it; on this device it asks ``torch.npu.is_bf16_supported()``, as ComfyUI asks an Intel
  XPU (``torch.xpu.is_bf16_supported()``). ComfyUI calls it through its module at every use, so the wrapper, set
  before the first prompt, reaches every dtype choice (``unet_dtype``, ``unet_manual_cast``, ``vae_dtype``, the text
  encoders') and the pack's.
"""

import functools
import sys

import comfy.model_management
import server
import simulated_accelerator
import torch
from aiohttp import web


def asking_the_device(should_use_bf16):
    """ComfyUI's ``should_use_bf16``, no for the simulated device (``None``: ComfyUI's current device) where the
    device has no bf16; ComfyUI's own answer otherwise (``--force-fp32``, another device)."""
    @functools.wraps(should_use_bf16)
    def answer(device=None, *args, **kwargs):
        on_this_device = device is None or torch.device(device).type == simulated_accelerator.DEVICE_TYPE
        if on_this_device and not torch.npu.is_bf16_supported():
            return False
        return should_use_bf16(device, *args, **kwargs)
    return answer


if not torch.npu.is_bf16_supported():
    comfy.model_management.should_use_bf16 = asking_the_device(comfy.model_management.should_use_bf16)


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
