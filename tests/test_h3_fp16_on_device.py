"""h3_fp16_overflow end to end: MiniMax H3 on a simulated device that computes fp16 but has no bf16
(tests/simulated_device, ``BF16_ENV``: ComfyUI's ``should_use_bf16`` says no there, as on an RTX 20xx, a V100 or an
RDNA2 card), through real ComfyUI servers, with a DiT whose activations leave fp16's range as the real model's do
(``synthetic_models.write_h3_fp16_models``: condition_proj's output, the attention sink's growth, the branch outputs).

The bundled text-to-video workflow and the official text-to-video template, each with the stock loaders and with the
pack's, without and with ``--fp16-unet``:

* stock: ComfyUI computes H3 in float32 (its log: ``model weight dtype torch.float32, manual cast: None``), correct
  and slow: the reference of the other runs; with ``--fp16-unet`` (``model weight dtype torch.float16``) non-finite
  latents, black frames, NaN audio that SaveVideo cannot encode (the red control: the test fails where they are
  finite);
* the pack: its loader makes ComfyUI compute in float16 (the pack's log line "MiniMax H3 computes in float16"), and
  with ``--fp16-unet`` ComfyUI does; finite both ways, close to the float32 run.

Under the legacy loader and under dynamic VRAM (the stand-in comfy-aimdo) on ComfyUI 0.33.0, and the workflow under
the legacy loader on the 0.39-era core (its newer DiT, ops.py and text encoder; there the latents are compared: the
synthetic video VAE decodes to NaN on that core's vae.py for every run, stock float32 included).

The table (core, memory manager, loaders, flag, the dtype ComfyUI chose from its own log, outcome, max abs diff
against the float32 run) is printed as it is measured. For CI time, one server per memory manager serves all four
runs of a graph:
* both loaders in the server with the pack: the fix is per model, so a stock loader's DiT gets nothing of it
  (asserted: no ``h3_fp16_overflow`` line for it), and no process-wide fix touches dtypes;
* ``--fp16-unet`` is set on the running server (the probe's ``/probe/load_args``): ComfyUI reads it only when it loads
  a model, and every prompt loads its models afresh (``--cache-none``); ComfyUI's log line shows it took effect.
Text encoders compute in float32 (``--fp32-text-enc``), so that every run conditions on the same states; the VAEs
in what ComfyUI picks on this device, as a user's do (the video VAE in float16: it declares fp16 among its dtypes).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from hotfix_testing import simulated_cores, synthetic_models
from hotfix_testing.comfyui_server import SimulatedDevice, http, simulated_accelerator_module
from hotfix_testing.seed_scenarios import H3_RESIDENT_MB, RESERVE_MB, fix_state, run, template_workflows, workflows
from hotfix_testing.workflow_prompts import official_template_inputs

pytestmark = pytest.mark.skipif(not simulated_cores.available(), reason="needs ../shared/comfyui (simulated cores)")

FIX = "h3_fp16_overflow"
FP16_UNET = "--fp16-unet"
# video and audio latents, decoded frames; on the 0.39-era core the latents only: the synthetic video VAE, written
# for 0.33.0's vae.py, decodes to NaN on that core's whatever the DiT gives it (stock float32 too)
COMPARED = {"0.33.0": ("sampled.latent_0", "sampled.latent_1", "sampled.images"),
            "0.39 era": ("sampled.latent_0", "sampled.latent_1")}
# fp16 branches beside a float32 stream, 2 steps of the tiny DiT: measured 2.5e-3 against the float32 run
TOLERANCE = 2e-2
TOTAL_MB = RESERVE_MB + H3_RESIDENT_MB["full"]  # every model resident
WEIGHT_DTYPE = re.compile(r"model weight dtype torch\.(\w+), manual cast: (?:torch\.)?(\w+)")
PACK_FP16 = re.compile(rf"MiniMax Hotfix: {FIX}: MiniMax H3 computes in float16")
TABLE = ("core", "memory manager", "loaders", "flag", "dtype ComfyUI chose (its log)", "outcome",
         "max abs diff vs float32")


@dataclasses.dataclass(frozen=True)
class DeviceWithoutBf16(SimulatedDevice):
    """The simulated device reporting fp16 but no bf16 (``simulated_accelerator.BF16_ENV``), without
    ``--force-fp32``, which would make ComfyUI refuse fp16 as well."""

    force_fp32: bool = False

    def environment(self) -> dict:
        return {**super().environment(), simulated_accelerator_module().BF16_ENV: "0"}


@pytest.fixture(scope="module")
def fp16_models(tmp_path_factory, comfyui):
    folder = tmp_path_factory.mktemp("h3_fp16_models") / "models"
    loras = frozenset(name for kind, name in official_template_inputs()[0] if kind == "loras")
    synthetic_models.write_h3_fp16_models(folder, loras)
    return folder


def finite(result: dict) -> bool:
    return all(bool(torch.isfinite(result["tensors"][name]).all()) for name in COMPARED[result["core"]])


def max_abs_diff(result: dict, reference: dict) -> float:
    return max((result["tensors"][name] - reference["tensors"][name]).abs().max().item()
               for name in COMPARED[result["core"]])


def run_reading_the_log(server, core: str, workflow: dict, tag: str, fp16_unet: bool) -> dict:
    """``seed_scenarios.run`` with ``--fp16-unet`` set or not, plus what ComfyUI's log says of the DiT's dtype
    (``weight_dtypes``: weight, manual cast) and whether the pack chose float16."""
    url, _, base = server
    status, body = http(url + "/probe/load_args", {"fp16_unet": fp16_unet})
    assert status == 200 and json.loads(body) == {"fp16_unet": fp16_unet}, body.decode()
    log = base / "comfyui.log"
    start = len(log.read_text())
    result = run(server, workflow, tag, TOTAL_MB)
    text = log.read_text()[start:]
    return {**result, "core": core, "weight_dtypes": WEIGHT_DTYPE.findall(text),
            "pack_fp16": bool(PACK_FP16.search(text))}


def table_row(loader: str, graph: str, flag: str, loaders: str, result: dict, reference: dict) -> tuple:
    ((weight, manual_cast),) = result["weight_dtypes"]
    chosen = f"{weight}, manual cast {manual_cast}" + ("; pack: float16" if result["pack_fp16"] else "")
    outcome = ("finite" if finite(result) else "NaN") + (f" ({result['error']})" if result["error"] else "")
    diff = f"{max_abs_diff(result, reference):.1e}" if finite(result) else "-"
    return result["core"], loader, f"{loaders} ({graph})", flag, chosen, outcome, diff


def stock_and_pack(server, core: str, loader: str, graph: str, pack_workflow: dict, stock_workflow: dict,
                   capsys) -> dict:
    """Both loaders without and with ``--fp16-unet``: {(flag, loaders): result}, the rows printed."""
    runs = {(flag, loaders): run_reading_the_log(server, core, workflow, f"{graph}_{loaders}_{flag.strip('-')}",
                                                  flag == FP16_UNET)
            for flag in ("-", FP16_UNET) for loaders, workflow in (("stock", stock_workflow), ("pack", pack_workflow))}
    with capsys.disabled():
        print("\n" + " | ".join(TABLE))
        for (flag, loaders), result in runs.items():
            print(" | ".join(table_row(loader, graph, flag, loaders, result, runs["-", "stock"])))
    return runs


def assert_stock_float32_or_black_and_the_pack_float16(runs: dict) -> None:
    reference = runs["-", "stock"]
    for key in (("-", "stock"), ("-", "pack"), (FP16_UNET, "pack")):
        assert runs[key]["error"] is None, (key, runs[key]["error"])
    assert reference["weight_dtypes"] == [("float32", "None")] and not reference["pack_fp16"], reference
    assert finite(reference)
    assert runs["-", "pack"]["weight_dtypes"] == [("float32", "None")] and runs["-", "pack"]["pack_fp16"]
    for loaders in ("stock", "pack"):
        assert runs[FP16_UNET, loaders]["weight_dtypes"] == [("float16", "None")], runs[FP16_UNET, loaders]
        assert not runs[FP16_UNET, loaders]["pack_fp16"]  # ComfyUI computes in float16 already
    # red control: the overflow this DiT carries blackens stock float16
    assert not finite(runs[FP16_UNET, "stock"]), "stock float16 came out finite: the DiT no longer overflows"
    for flag in ("-", FP16_UNET):
        pack = runs[flag, "pack"]
        assert finite(pack) and max_abs_diff(pack, reference) <= TOLERANCE, flag
        assert any(line.startswith(f"MiniMax Hotfix: {FIX} attached") for line in pack["fix_lines"]), flag
        assert not any(FIX in line for line in runs[flag, "stock"]["fix_lines"]), flag


def server_without_bf16(device_servers, models, core: str, loader: str):
    server = device_servers(core, True, DeviceWithoutBf16(total_mb=TOTAL_MB, dynamic_vram=loader == "dynamic"), models,
                            options=("--fp32-text-enc",))
    assert fix_state(server[2], FIX) == "needed"
    return server


@pytest.mark.parametrize("core, loader", [("0.33.0", "legacy"), ("0.33.0", "dynamic"), ("0.39 era", "legacy")])
def test_bundled_h3_workflow_without_bf16(core, loader, device_servers, fp16_models, capsys):
    pack_workflow, stock_workflow = workflows()
    runs = stock_and_pack(server_without_bf16(device_servers, fp16_models, core, loader), core, loader, "workflow",
                          pack_workflow, stock_workflow, capsys)
    assert {result["loader"] for result in runs.values()} == {loader}
    assert_stock_float32_or_black_and_the_pack_float16(runs)


def test_official_h3_template_without_bf16(device_servers, fp16_models, capsys):
    """The official text-to-video template as shipped (stock loaders inside its subgraph) and swapped."""
    pack_workflow, stock_workflow = template_workflows("video_minimax_h3_t2v")
    runs = stock_and_pack(server_without_bf16(device_servers, fp16_models, "0.33.0", "legacy"), "0.33.0", "legacy",
                          "template", pack_workflow, stock_workflow, capsys)
    assert_stock_float32_or_black_and_the_pack_float16(runs)
