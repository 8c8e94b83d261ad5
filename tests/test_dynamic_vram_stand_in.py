"""The stand-in comfy-aimdo (tests/simulated_device/dynamic_vram/comfy_aimdo) does not drift from the real package:
every public function, class and method of the comfy-aimdo installed beside ComfyUI (its requirements pin 0.4.13; the
real package imports without CUDA) exists in the stand-in with the same parameters: names, kinds and defaults, the
annotations aside. What the stand-in adds is the simulated device's own bookkeeping (``STAND_IN_ONLY``). What the
newest comfy-aimdo (0.6.0) changed and what the stand-in does about it: docs/testing.md, "Dynamic VRAM"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STAND_IN = Path(__file__).resolve().parent / "simulated_device" / "dynamic_vram"
# The stand-in's additions: the budget, eviction and counters that the simulated device's route sets and reads, the
# device tensors its slots and cast buffers are (``tensor``: what ``comfy_aimdo.torch`` maps an allocation to), and a
# logging switch ComfyUI's newer cores call where it exists
STAND_IN_ONLY = {"comfy_aimdo.control.set_log_detail", "comfy_aimdo.model_vbar.Slot", "comfy_aimdo.model_vbar.all_vbars",
                 "comfy_aimdo.model_vbar.count", "comfy_aimdo.model_vbar.evict", "comfy_aimdo.model_vbar.make_room",
                 "comfy_aimdo.model_vbar.reset_counters", "comfy_aimdo.model_vbar.resident_bytes",
                 "comfy_aimdo.model_vbar.room", "comfy_aimdo.model_vbar.set_budget", "comfy_aimdo.model_vbar.stats",
                 "comfy_aimdo.model_vbar.ModelVBAR.slots_in", "comfy_aimdo.model_vbar.ModelVBAR.tensor",
                 "comfy_aimdo.vram_buffer.VRAMBuffer.tensor"}

SURFACE = r'''
import importlib, inspect, json, pkgutil
import comfy_aimdo

def parameters(function):
    return [[p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
            for p in inspect.signature(function).parameters.values()]

surface = {}
for info in pkgutil.iter_modules(comfy_aimdo.__path__):
    name = f"comfy_aimdo.{info.name}"
    try:
        module = importlib.import_module(name)
    except ImportError:  # the native libraries (aimdo.so) are ctypes libraries beside the modules
        continue
    for attr, value in vars(module).items():
        if attr.startswith("_") or getattr(value, "__module__", None) != name:
            continue
        if inspect.isfunction(value):
            surface[f"{name}.{attr}"] = parameters(value)
        elif inspect.isclass(value):
            surface[f"{name}.{attr}"] = parameters(value.__init__) if "__init__" in vars(value) else []
            for method, function in vars(value).items():
                if inspect.isfunction(function) and not method.startswith("_"):
                    surface[f"{name}.{attr}.{method}"] = parameters(function)
import importlib.metadata
version = getattr(comfy_aimdo, "__version__", None) or importlib.metadata.version("comfy-aimdo")
print(json.dumps({"version": version, "surface": surface}))
'''


def surface(stand_in: bool) -> dict:
    environment = {**os.environ, "PYTHONPATH": str(STAND_IN) if stand_in else ""}
    done = subprocess.run([sys.executable, "-c", SURFACE], capture_output=True, text=True, env=environment,
                          cwd="/", check=False, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def drift(real: dict, stand_in: dict) -> list[str]:
    """What the stand-in lacks or answers differently, and what it adds beyond ``STAND_IN_ONLY``."""
    found = [f"{name}: missing in the stand-in" for name in sorted(set(real) - set(stand_in))]
    found += [f"{name}: real {real[name]}, stand-in {stand_in[name]}" for name in sorted(set(real) & set(stand_in))
              if real[name] != stand_in[name]]
    found += [f"{name}: only in the stand-in" for name in sorted(set(stand_in) - set(real) - STAND_IN_ONLY)]
    return found


def test_the_stand_in_keeps_the_real_packages_public_functions(comfyui):
    pytest.importorskip("comfy_aimdo")
    real, stand_in = surface(stand_in=False), surface(stand_in=True)
    assert stand_in["version"].endswith("+simulated") and not real["version"].endswith("+simulated")
    print(f"\ncomfy-aimdo {real['version']} against the stand-in {stand_in['version']}: {len(real['surface'])} public "
          "names compared")
    assert drift(real["surface"], stand_in["surface"]) == []
    assert STAND_IN_ONLY <= set(stand_in["surface"]), "a declared addition the stand-in no longer has"


def test_a_drift_is_found():
    # red control: a function renamed, a parameter dropped, a default changed, an addition not declared
    real = {"m.init": [["implementation", "POSITIONAL_OR_KEYWORD", "None"]], "m.gone": []}
    stand_in = {"m.init": [["implementation", "POSITIONAL_OR_KEYWORD", "'cuda'"]], "m.extra": []}
    assert drift(real, stand_in) == ["m.gone: missing in the stand-in",
                                     "m.init: real [['implementation', 'POSITIONAL_OR_KEYWORD', 'None']], stand-in "
                                     "[['implementation', 'POSITIONAL_OR_KEYWORD', \"'cuda'\"]]",
                                     "m.extra: only in the stand-in"]
