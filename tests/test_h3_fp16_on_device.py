"""h3_fp16_overflow end to end: MiniMax H3 on a simulated device that computes fp16 but has no bf16
(tests/simulated_device, ``BF16_ENV``: ComfyUI's ``should_use_bf16`` says no there, as on an RTX 20xx, a V100 or an
RDNA2 card), through real ComfyUI servers, with a DiT whose activations leave fp16's range as the real model's do
(``synthetic_models.write_h3_fp16_models``: condition_proj's output, the attention sink's growth, the branch outputs).

The bundled text-to-video workflow and the official text-to-video template (its DiT the int8 ConvRot form,
``synthetic_models.H3_FP16_INT8_DIT_FILE``, which ComfyUI computes through its mixed-precision ops), each with the
stock loaders and with the pack's, without and with ``--fp16-unet``:

* stock: ComfyUI computes H3 in float32 (its log: ``model weight dtype torch.float32, manual cast: None``), correct
  and slow: the reference of the other runs; with ``--fp16-unet`` (``model weight dtype torch.float16``) non-finite
  latents, black frames, NaN audio that SaveVideo cannot encode (the red control: the test fails where they are
  finite). The int8 DiT keeps computing in float32 under ``--fp16-unet`` (its log: ``manual cast: torch.float32``:
  the flag sets the dtype of its unquantized weights only); ComfyUI's ModelComputeDtype node set to fp16 forces it,
  and blackens it (its red control);
* the pack: its loader makes ComfyUI compute in float16 (the pack's log line "MiniMax H3 computes in float16"), and
  with ``--fp16-unet`` ComfyUI does; finite both ways, close to the float32 run.

Under the legacy loader and under dynamic VRAM (the stand-in comfy-aimdo) on ComfyUI 0.33.0, and the workflow under
the legacy loader on the 0.39-era core (its newer DiT, ops.py and text encoder; there the latents are compared: the
synthetic video VAE decodes to NaN on that core's vae.py for every run, stock float32 included).

The workflow with its DiT from ComfyUI-GGUF's ``UnetLoaderGGUF`` (the stand-in, tests/comfyui_gguf_stand_in; the Q8_0
form of the DiT), on 0.33.0 under both memory managers: stock (ComfyUI's float32), through the Apply node (float16,
chosen on the node's own clone), through server-side fixing (the server inserts that Apply node), and the sequence
that broke a public fp16 pack: the Apply node deleted between two runs, the GGUF loader's cached patcher reused,
which must compute as stock does; its red control makes the choice on the patcher the Apply node is handed
(the probe's ``/probe/apply_model_chooses_on_its_input``): the cached patcher then computes in float16 without the
fix, NaN.

The table (core, memory manager, loaders, flag, the dtype ComfyUI chose from its own log, outcome, max abs diff
against the float32 run) is printed as it is measured. For CI time, one server per core and memory manager serves
every run of this file there:
* both loaders in the server with the pack: the fix is per model, so a stock loader's DiT gets nothing of it
  (asserted: no ``h3_fp16_overflow`` line for it), and no process-wide fix touches dtypes;
* ``--fp16-unet`` is set on the running server (the probe's ``/probe/load_args``): ComfyUI reads it only when it loads
  a model, and every prompt loads its models afresh (unloaded and the node cache cleared before it, but in the
  cached-patcher sequence: the server caches, as a user's does); ComfyUI's log line shows it took effect.
Text encoders compute in float32 (``--fp32-text-enc``), so that every run conditions on the same states; the VAEs
in what ComfyUI picks on this device, as a user's do (the video VAE in float16: it declares fp16 among its dtypes).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import re

import pytest
import torch

from hotfix_testing import simulated_cores, synthetic_models
from hotfix_testing.comfyui_server import SimulatedDevice, http, simulated_accelerator_module
from hotfix_testing.seed_scenarios import H3_RESIDENT_MB, RESERVE_MB, fix_state, run, template_workflows, workflows
from hotfix_testing.workflow_prompts import h3_prompt, official_template_inputs
from minimax_hotfix import swap_loaders
from minimax_hotfix.registry.prompt_fixing import FIX_EVERY_RUN_SETTING

pytestmark = pytest.mark.skipif(not simulated_cores.available(), reason="needs ../shared/comfyui (simulated cores)")

FIX = "h3_fp16_overflow"
FP16_UNET = "--fp16-unet"
FORCED_FP16 = "ModelComputeDtype fp16"  # ComfyUI's node setting the compute dtype, between the DiT's loader and use
# video and audio latents, decoded frames; on the 0.39-era core the latents only: the synthetic video VAE, written
# for 0.33.0's vae.py, decodes to NaN on that core's whatever the DiT gives it (stock float32 too)
COMPARED = {"0.33.0": ("sampled.latent_0", "sampled.latent_1", "sampled.images"),
            "0.39 era": ("sampled.latent_0", "sampled.latent_1")}
# fp16 branches beside a float32 stream, 2 steps of the tiny DiT: measured 2.5e-3 against the float32 run
TOLERANCE = 2e-2
TOTAL_MB = RESERVE_MB + H3_RESIDENT_MB["full"]  # every model resident
WEIGHT_DTYPE = re.compile(r"model weight dtype torch\.(\w+), manual cast: (?:torch\.)?(\w+)")
PACK_FP16 = re.compile(rf"MiniMax Hotfix: {FIX}: MiniMax H3 computes in float16")
SAFETY_NET = "left float16's range"  # the safety net's line: a DiT call ran again in float32
SERVER_SIDE_FIXING = "MiniMax Hotfix: fixed a prompt on the server"
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


def run_reading_the_log(server, core: str, workflow: dict, tag: str, fp16_unet: bool = False, **options) -> dict:
    """``seed_scenarios.run`` (with its ``options``) with ``--fp16-unet`` set or not, plus what ComfyUI's log says of
    the DiT's dtype (``weight_dtypes``: weight, manual cast; none where no model was loaded), whether the pack chose
    float16, whether its safety net ran a DiT call again in float32, and the log itself."""
    url, _, base = server
    status, body = http(url + "/probe/load_args", {"fp16_unet": fp16_unet})
    assert status == 200 and json.loads(body) == {"fp16_unet": fp16_unet}, body.decode()
    log = base / "comfyui.log"
    start = len(log.read_text())
    result = run(server, workflow, tag, TOTAL_MB, **options)
    text = log.read_text()[start:]
    return {**result, "core": core, "weight_dtypes": WEIGHT_DTYPE.findall(text),
            "pack_fp16": bool(PACK_FP16.search(text)), "net_tripped": SAFETY_NET in text, "log": text}


def table_row(loader: str, graph: str, flag: str, loaders: str, result: dict, reference: dict) -> tuple:
    loads = "; ".join(f"{weight}, manual cast {manual_cast}" for weight, manual_cast in result["weight_dtypes"])
    chosen = (loads or "no load (the loader's cached patcher)") + ("; pack: float16" if result["pack_fp16"] else "")
    sampled = all(name in result["tensors"] for name in COMPARED[result["core"]])
    outcome = ("no output" if not sampled else "finite" if finite(result) else "NaN") + (
        " (safety net tripped)" if result["net_tripped"] else "") + (f" ({result['error']})" if result["error"] else "")
    diff = f"{max_abs_diff(result, reference):.1e}" if sampled and finite(result) else "-"
    return result["core"], loader, f"{loaders} ({graph})", flag, chosen, outcome, diff


def print_table(loader: str, graph: str, runs: dict, capsys) -> None:
    """``runs``: {(flag, loaders): result}, each a row against the stock run without a flag."""
    with capsys.disabled():
        print("\n" + " | ".join(TABLE))
        for (flag, loaders), result in runs.items():
            print(" | ".join(table_row(loader, graph, flag, loaders, result, runs["-", "stock"])))


def stock_and_pack(server, core: str, graph: str, pack_workflow: dict, stock_workflow: dict,
                   make_prompt=h3_prompt) -> dict:
    """Both loaders without and with ``--fp16-unet``: {(flag, loaders): result}."""
    return {(flag, loaders): run_reading_the_log(server, core, workflow, f"{graph}_{loaders}_{flag.strip('-')}",
                                                  flag == FP16_UNET, make_prompt=make_prompt)
            for flag in ("-", FP16_UNET) for loaders, workflow in (("stock", stock_workflow), ("pack", pack_workflow))}


def comfyui_dtype(result: dict) -> str:
    """The dtype ComfyUI set the DiT to compute in at its load (its log): its manual cast dtype, or its weight dtype
    where it casts nothing."""
    ((weight, manual_cast),) = result["weight_dtypes"]
    return weight if manual_cast == "None" else manual_cast


def compute_dtype(flag: str, result: dict) -> str:
    """What the DiT computed in: float16 where the pack chose it or ComfyUI's ModelComputeDtype node forced it, else
    ComfyUI's choice."""
    return "float16" if result["pack_fp16"] or flag == FORCED_FP16 else comfyui_dtype(result)


def assert_stock_float32_or_black_and_the_pack_float16(runs: dict) -> None:
    """Stock computes in float32 (the reference: correct) or, forced into float16, gives non-finite output (the red
    control: at least one such run, else the test fails where they are finite); the pack computes in float16, finite
    and close to the reference, with its fix attached; ``--fp16-unet`` reached ComfyUI (the weights in float16)."""
    reference = runs["-", "stock"]
    assert compute_dtype("-", reference) == "float32" and finite(reference), reference["weight_dtypes"]
    for (flag, loaders), result in runs.items():
        dtype = compute_dtype(flag, result)
        if flag == FP16_UNET:
            assert result["weight_dtypes"][0][0] == "float16", (flag, loaders, result["weight_dtypes"])
        if loaders == "pack":
            assert dtype == "float16" and result["error"] is None, (flag, result["weight_dtypes"], result["error"])
            # the pack chooses float16 exactly where ComfyUI alone computes in float32
            assert result["pack_fp16"] is (comfyui_dtype(result) == "float32"), (flag, result["weight_dtypes"])
            assert finite(result) and max_abs_diff(result, reference) <= TOLERANCE, flag
            assert any(line.startswith(f"MiniMax Hotfix: {FIX} attached") for line in result["fix_lines"]), flag
            continue
        assert not result["pack_fp16"] and not any(FIX in line for line in result["fix_lines"]), flag
        # red control: the overflow this DiT carries blackens stock float16
        assert finite(result) is (dtype == "float32"), f"stock {flag} in {dtype}: finite {finite(result)}"
        if dtype == "float32":
            assert result["error"] is None and max_abs_diff(result, reference) <= TOLERANCE, flag
    assert any(loaders == "stock" and compute_dtype(flag, result) == "float16" for (flag, loaders), result in
               runs.items()), "no stock run in float16: the table has no red control"


def server_without_bf16(device_servers, models, core: str, loader: str):
    """The one server per core and memory manager; it caches (``run`` clears the cache but where a test keeps it)."""
    server = device_servers(core, True, DeviceWithoutBf16(total_mb=TOTAL_MB, dynamic_vram=loader == "dynamic"), models,
                            cache=True, options=("--fp32-text-enc",))
    assert fix_state(server[2], FIX) == "needed"
    return server


@pytest.mark.parametrize("core, loader", [("0.33.0", "legacy"), ("0.33.0", "dynamic"), ("0.39 era", "legacy")])
def test_bundled_h3_workflow_without_bf16(core, loader, device_servers, fp16_models, capsys):
    pack_workflow, stock_workflow = workflows()
    runs = stock_and_pack(server_without_bf16(device_servers, fp16_models, core, loader), core, "workflow",
                          pack_workflow, stock_workflow)
    print_table(loader, "workflow", runs, capsys)
    assert {result["loader"] for result in runs.values()} == {loader}
    assert_stock_float32_or_black_and_the_pack_float16(runs)


def int8_dit_prompt(workflow: dict, object_info: dict, tag: str, forced_fp16: bool = False) -> dict:
    """``h3_prompt`` with the DiT loader reading the overflowing DiT's int8 ConvRot form; with ``forced_fp16``, the
    DiT through ComfyUI's ModelComputeDtype node set to fp16, how a user forces float16 on an int8 model, whose
    compute dtype ``--fp16-unet`` leaves alone (ComfyUI's mixed-precision ops keep their manual cast)."""
    prompt = h3_prompt(workflow, object_info, tag)
    (loader,) = [key for key, node in prompt.items() if "unet_name" in node["inputs"]]
    prompt[loader]["inputs"]["unet_name"] = synthetic_models.H3_FP16_INT8_DIT_FILE
    if forced_fp16:
        for node in prompt.values():
            node["inputs"].update({name: ["forced_fp16", 0] for name, value in node["inputs"].items()
                                   if value == [loader, 0]})
        prompt["forced_fp16"] = {"class_type": "ModelComputeDtype", "inputs": {"model": [loader, 0], "dtype": "fp16"}}
    return prompt


@pytest.mark.parametrize("loader", ["legacy", "dynamic"])
def test_official_h3_template_without_bf16(loader, device_servers, fp16_models, capsys):
    """The official text-to-video template as shipped (stock loaders inside its subgraph) and swapped, its DiT an
    int8 ConvRot checkpoint; stock forced into float16 by ComfyUI's ModelComputeDtype node as well."""
    core, graph = "0.33.0", "template, int8_convrot"
    server = server_without_bf16(device_servers, fp16_models, core, loader)
    pack_workflow, stock_workflow = template_workflows("video_minimax_h3_t2v")
    runs = stock_and_pack(server, core, graph, pack_workflow, stock_workflow, make_prompt=int8_dit_prompt)
    runs[FORCED_FP16, "stock"] = run_reading_the_log(server, core, stock_workflow, "template_stock_forced_fp16",
                                                     make_prompt=functools.partial(int8_dit_prompt, forced_fp16=True))
    print_table(loader, graph, runs, capsys)
    assert {result["loader"] for result in runs.values()} == {loader}
    assert_stock_float32_or_black_and_the_pack_float16(runs)


# ---- ComfyUI-GGUF's UnetLoaderGGUF ----

DELETED = "Apply node deleted (cached GGUF loader)"
RED_APPLY = "red control: Apply node choosing on its input"
RED_DELETED = "red control: then Apply node deleted (cached GGUF loader)"


def gguf_workflows() -> tuple[dict, dict]:
    """(stock, through the Apply node) of the bundled workflow with its DiT from ComfyUI-GGUF's ``UnetLoaderGGUF``
    (the Q8_0 file) instead of UNETLoader: the stock one as an API client's script holds it, the other with an Apply
    node after the GGUF loader, as the browser's *Insert MiniMaxHotfixApplyModel after this node* puts it."""
    _, stock = workflows()
    (loader,) = [node for node in stock["nodes"] if node["type"] == "UNETLoader"]
    loader["type"], loader["widgets_values"] = "UnetLoaderGGUF", [synthetic_models.H3_FP16_GGUF_FILE]
    applied = copy.deepcopy(stock)
    assert swap_loaders.swap(applied, only={"graph": None, "node": loader["id"]}).inserted
    return stock, applied


@contextlib.contextmanager
def switched(url: str, route: str, on, off):
    """``POST url + route`` with ``on``, then with ``off`` however the block ends."""
    def post(body) -> None:
        status, answer = http(url + route, body)
        assert status == 200, answer.decode()

    post(on)
    try:
        yield
    finally:
        post(off)


def every_prompt_fixed(url: str):
    """Server-side fixing on for the default user (the setting *fix every run on this server*)."""
    return switched(url, f"/settings/{FIX_EVERY_RUN_SETTING}", True, False)


def apply_node_choosing_on_its_input(url: str):
    """The Apply node making its choices on the patcher it is handed (the probe's red control)."""
    return switched(url, "/probe/apply_model_chooses_on_its_input", {"on": True}, {"on": False})


@pytest.mark.parametrize("loader", ["legacy", "dynamic"])
def test_gguf_h3_through_the_apply_node_without_bf16(loader, device_servers, fp16_models, capsys):
    """The Q8_0 DiT from ComfyUI-GGUF's UnetLoaderGGUF, in the server of the workflow's runs:
    * through the Apply node: float16 (the pack's choice, on the node's own clone), finite, close to stock's float32;
    * then, the server caching as a user's does, the same graph with the Apply node deleted: ComfyUI loads nothing
      (the GGUF loader's cached patcher runs) and its output is stock's, bit for bit, the cached patcher untouched;
    * stock (the GGUF loader straight to the sampler): ComfyUI's float32, the reference;
    * the stock graph with server-side fixing on: the server inserts the Apply node: float16, finite, close;
    * red control: the same sequence with the Apply node choosing on the patcher it is handed (as a pack that sets
      the dtype on its input): the cached patcher keeps float16 without the fix, and the run with the node deleted
      is NaN."""
    core = "0.33.0"
    server = server_without_bf16(device_servers, fp16_models, core, loader)
    url = server[0]
    stock, applied = gguf_workflows()

    def queued(workflow: dict, tag: str, **options) -> dict:
        return run_reading_the_log(server, core, workflow, f"gguf_{loader}_{tag}", **options)

    runs = {"Apply node": queued(applied, "apply"), DELETED: queued(stock, "deleted", fresh=False),
            "stock": queued(stock, "stock")}
    with every_prompt_fixed(url):
        runs["server-side fixing"] = queued(stock, "server_side")
    with apply_node_choosing_on_its_input(url):
        runs[RED_APPLY] = queued(applied, "red_apply")
        runs[RED_DELETED] = queued(stock, "red_deleted", fresh=False)
    reference, deleted, red_deleted = runs["stock"], runs[DELETED], runs[RED_DELETED]
    print_table(loader, "workflow, GGUF Q8_0", {("-", loaders): result for loaders, result in runs.items()}, capsys)

    assert {result["loader"] for result in runs.values()} == {loader}
    errors = {key: result["error"] for key, result in runs.items()}
    assert not any(error for key, error in errors.items() if key != RED_DELETED), errors
    assert reference["weight_dtypes"] == [("float32", "None")] and not reference["pack_fp16"], reference["log"][-3000:]
    assert finite(reference)
    for key in ("Apply node", "server-side fixing"):
        fixed = runs[key]
        assert fixed["weight_dtypes"] == [("float32", "None")] and fixed["pack_fp16"], (key, fixed["log"][-3000:])
        assert finite(fixed) and max_abs_diff(fixed, reference) <= TOLERANCE, key
        assert any(line.startswith(f"MiniMax Hotfix: {FIX} attached") for line in fixed["fix_lines"]), key
    assert not any(FIX in line for line in reference["fix_lines"])
    (swapped,) = [line for line in runs["server-side fixing"]["log"].splitlines() if SERVER_SIDE_FIXING in line]
    assert "MiniMaxHotfixApplyModel" in swapped, swapped
    assert SERVER_SIDE_FIXING not in runs["stock"]["log"]
    # the cached-patcher sequence: nothing loaded, no choice made, stock's output
    for cached in (deleted, red_deleted):
        assert cached["weight_dtypes"] == [] and not cached["pack_fp16"], cached["log"][-3000:]
    assert all(torch.equal(deleted["tensors"][name], reference["tensors"][name]) for name in COMPARED[core])
    # red control: float16 left on the cached patcher, without the fix
    assert runs[RED_APPLY]["pack_fp16"]
    assert not finite(red_deleted), "the cached patcher computed finite in float16 without the fix: no red control"
