"""Runs the mutants of hotfix_testing/mutated_cores.py in one Python process, on the simulated accelerator or, for
scenarios that need the CPU's own rules (Music 3's emulated graph capture) or gain nothing from the device but time
(H3 in fp16), on the CPU alone: started by
``mutated_cores.run_on_core`` with one simulated core's tree (and the simulated device's folder) on ``PYTHONPATH``
(installing the device patches torch for the whole process, so this never runs beside other tests).

For each mutant named on the command line: its edited modules are executed under their own names in place of the
core's (``sys.modules`` and the parent package's attribute, put back afterwards), each fix's detection runs afresh,
and the mutant's scenario runs three times on a tiny model: on the CPU (the reference), loaded partly onto ``npu:0``
through ComfyUI's ModelPatcher without the pack (stock) and with the pack's fixes attached as its loaders attach them
(pack). One JSON line per mutant on stdout, prefixed ``MUTANT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import logging
import os
import sys
import tempfile
import traceback
from pathlib import Path

ON_DEVICE = os.environ.get("MINIMAX_HOTFIX_MUTANTS_DEVICE") != "cpu"  # set by mutated_cores.run_on_core
if ON_DEVICE:
    import torch_npu  # noqa: F401  (the simulated accelerator: ComfyUI adopts npu:0 through its Ascend path)
from comfy.cli_args import args

args.cpu = not ON_DEVICE
args.disable_pinned_memory = args.force_fp32 = ON_DEVICE  # the simulated device's values are float32 CPU values
import comfy.model_management  # noqa: E402
import comfy.model_patcher  # noqa: E402
import torch  # noqa: E402

from hotfix_testing import mutated_cores  # noqa: E402
from hotfix_testing.mutated_cores import compared  # noqa: E402
from hotfix_testing.registry_state import forget_detection  # noqa: E402
from minimax_hotfix import registry  # noqa: E402
from minimax_hotfix.contract import error_line  # noqa: E402

PACK_ROOT = Path(__file__).resolve().parents[2]
NPU = torch.device("npu", 0) if ON_DEVICE else None
CPU = torch.device("cpu")
LOAD_DEVICE = NPU or CPU  # where run_loaded loads a model: the CPU in a run of CPU scenarios
WORK = Path(tempfile.mkdtemp(prefix="mutants-"))
PROCESS = "process"  # a scenario's target for the process-wide fixes, installed as ComfyUI's start-up installs them


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


@contextlib.contextmanager
def mutated_modules(tree: Path, mutant: mutated_cores.Mutant):
    """The mutant's files executed in place of the core's modules, its function edits in place of the functions."""
    folder = WORK / str(len(list(WORK.iterdir())))
    saved = {}
    try:
        for path, source in mutated_cores.mutated_sources(tree, mutant).items():
            name = module_name(path)
            parent_name, _, leaf = name.rpartition(".")
            parent = sys.modules[parent_name]
            saved[name] = (sys.modules.get(name), getattr(parent, leaf, None))
            file = folder / path
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(source, encoding="utf-8")
            spec = importlib.util.spec_from_file_location(name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            setattr(parent, leaf, module)
        with mutated_cores.functions_edited(mutant, folder):
            yield
    finally:
        for name, (module, attribute) in reversed(saved.items()):
            parent_name, _, leaf = name.rpartition(".")
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
            if attribute is None:
                if hasattr(sys.modules[parent_name], leaf):
                    delattr(sys.modules[parent_name], leaf)
            else:
                setattr(sys.modules[parent_name], leaf, attribute)


def run_loaded(build, run, with_pack: bool, target: str, resident_fraction: float) -> dict:
    """``run(model, device)`` on ``build()`` loaded by ComfyUI's ModelPatcher onto npu:0 (the CPU, in a run of CPU
    scenarios) with ``resident_fraction`` of its weights resident, the rest cast per call as in lowvram, with the
    pack's fixes for ``target`` attached or not."""
    model = build()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=LOAD_DEVICE, offload_device=CPU)
    if target == PROCESS:
        attached = registry.install_process_fixes() if with_pack else []
    else:
        attached = registry.attach_fixes(patcher, target) if with_pack else []
    size = comfy.model_management.module_size(model)
    accelerator = sys.modules.get("simulated_accelerator")  # absent in a run of CPU scenarios: no bus to count
    if accelerator:
        accelerator.reset_counters()
    try:
        patcher.patch_model(device_to=LOAD_DEVICE, lowvram_model_memory=max(1, int(size * resident_fraction)))
        out = run(model, LOAD_DEVICE)
        result = {"output": out.to(CPU)}
    except Exception as exc:  # noqa: BLE001  (the outcome of the run is what is measured)
        result = {"error": error_line(exc)}
    finally:
        patcher.unpatch_model(CPU)
        if with_pack and target == PROCESS:
            registry.uninstall_process_fixes()
        elif with_pack:
            registry.detach_fixes(patcher, target)
    result["h2d"] = sum(nbytes for _, nbytes in accelerator.host_to_device().values()) if accelerator else 0
    result["attached"] = attached
    return result


def stock_and_pack(build, run, target: str, resident_fraction: float) -> dict:
    """``run_loaded`` without the pack (stock) and with it (pack)."""
    return {label: run_loaded(build, run, with_pack, target, resident_fraction)
            for label, with_pack in (("stock", False), ("pack", True))}


def scenario_outcome(scenario) -> dict:
    """The scenario's CPU reference, stock and pack runs, compared; in inference mode, as ComfyUI runs a prompt
    (its loaders build the models there too)."""
    build, run, target, fraction, *reference_run = scenario
    try:
        reference = (reference_run[0] if reference_run else run)(build(), CPU)
    except Exception as exc:  # noqa: BLE001  (a mutant that breaks the core itself tests nothing)
        return {"invalid": f"the CPU reference run fails: {error_line(exc)}"}
    return compared(stock_and_pack(build, run, target, fraction), reference)


def start_pack() -> dict:
    """The pack loaded by ComfyUI's own ``load_custom_node``, as its start-up loads a custom node, against the mutated
    modules; a fresh copy each time (its modules dropped before and after), its process-wide fixes uninstalled after,
    so later mutants start from stock again."""
    import nodes

    name = str(PACK_ROOT).replace(".", "_x_")  # the module name load_custom_node gives a folder

    def drop_copy():
        for module in [module for module in sys.modules if module == name or module.startswith(name + ".")]:
            del sys.modules[module]

    drop_copy()
    stock = set(nodes.NODE_CLASS_MAPPINGS)
    problems = mutated_cores.Problems()
    logging.getLogger().addHandler(problems)
    try:
        loaded = asyncio.run(nodes.load_custom_node(str(PACK_ROOT), ignore=stock))
    finally:
        logging.getLogger().removeHandler(problems)
        copy = sys.modules.get(name + ".registry")
        if copy is not None:
            copy.uninstall_process_fixes()
        drop_copy()
    added = sorted(set(nodes.NODE_CLASS_MAPPINGS) - stock)
    for node in added:
        del nodes.NODE_CLASS_MAPPINGS[node]
    return {"loaded": loaded, "nodes": added, "problems": problems.found}


def run_mutant(tree: Path, mutant: mutated_cores.Mutant) -> dict:
    record = {"mutant": mutant.name}
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(mutated_modules(tree, mutant))
        except Exception as exc:  # noqa: BLE001
            record["core_error"] = error_line(exc)
            return record
        forget_detection(registry)
        try:
            found = registry.status(registry.fix_named(mutant.fix))
            record["state"], record["reason"] = found.state.value, found.reason
        except Exception:  # noqa: BLE001
            record["pack_traceback"] = traceback.format_exc()
            return record
        try:
            if mutant.scenario in OWN_RUNS:
                record.update(OWN_RUNS[mutant.scenario](mutant))
            else:
                with torch.inference_mode():
                    record.update(scenario_outcome(SCENARIOS[mutant.scenario](mutant)))
        except Exception:  # noqa: BLE001
            record["pack_traceback"] = traceback.format_exc()
        record["startup"] = start_pack()
    return record


# --- scenarios: (build, run, target, resident fraction) -------------------------------------------------------------

def vae_decode(mutant):
    """A tiny H3 video decoder (two blocks) half resident: the seed 000 scenario."""
    vae = importlib.import_module(mutant.module or "comfy.ldm.minimax.vae")
    decoder_class = getattr(vae, mutant.target_class or "ViT3DDecoder")

    def build():
        torch.manual_seed(0)
        decoder = decoder_class(patch_size=2, patch_size_t=1, in_channels=4, out_channels=3, num_layers=2, heads=2,
                                dim_head=32)
        with torch.no_grad():
            for parameter in decoder.parameters():
                parameter.copy_(torch.randn(parameter.shape) * 0.05)
        return decoder

    latent = torch.randn(1, 4, 2, 2, 2, generator=torch.Generator().manual_seed(1))
    return build, lambda model, device: model(latent.to(device)), "vae", 0.5


def vae_decode_process_fixes(mutant):
    """seed 000's decode with the process-wide fixes instead of the VAE's own (comfy-kitchen's rope aligned)."""
    build, run, _, fraction = vae_decode(mutant)
    return build, run, PROCESS, fraction


def vision_tower(mutant):
    """A tiny Qwen3-VL vision tower with all but a sliver of it offloaded: the seed 001 scenario."""
    import comfy.ops
    import comfy.text_encoders.qwen3vl

    from minimax_hotfix.diagnostics.self_tests.qwen3vl_pos_embed import outputs, tiny_pixels
    from minimax_hotfix.kernels.qwen3vl_pos_embed import TINY_QWEN3VL_GRID, tiny_qwen3vl_tower

    pixels, grid = tiny_pixels(), torch.tensor(TINY_QWEN3VL_GRID)

    def build():
        return tiny_qwen3vl_tower(comfy.text_encoders.qwen3vl.Qwen3VLVisionModel, comfy.ops.manual_cast)

    def run(tower, device):
        return torch.cat([output.flatten() for output in outputs(tower(pixels.to(device), grid))])

    return build, run, "clip", 0.05


def int8_vae(mutant):
    """An int8 layer of the H3 video VAE's kind (built as comfy/sd.py builds it) on a device without
    ``torch._int_mm``, called through ``linear_input_act`` as the decoder's MLP calls it: the seed 004 scenario.
    ``mutant.target_class`` names the fused function where the mutant renamed it ("-": removed, callers compute
    ``linear(act(x))`` themselves)."""
    import comfy.ops
    import simulated_accelerator

    from minimax_hotfix.kernels.int8_full_precision_mm import tiny_int8_linear

    simulated_accelerator.set_int_mm(False)
    gated = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    function_name = mutant.target_class or "linear_input_act"

    def build():
        return torch.nn.ModuleDict({"layer": tiny_int8_linear(comfy.ops, 64, 16)})

    def reference(model, device):  # the CPU computes int8 in int8 (it has _int_mm): the dequantized weight's result
        layer = model["layer"]
        return torch.nn.functional.linear(comfy.ops._swiglu_eager(gated), layer.weight.dequantize())

    def run(model, device):
        ops = sys.modules["comfy.ops"]  # looked up per call, as the core's modules do
        if function_name == "-":
            return model["layer"](ops._swiglu_eager(gated.to(device)))
        function = getattr(ops, function_name)
        given = {"linear": model["layer"], "x": gated.to(device), "input_act": "swiglu"}
        arguments = {name: given.get(name) for name, parameter in inspect.signature(function).parameters.items()
                     if name in given or parameter.default is inspect.Parameter.empty}
        return function(**arguments)

    return build, run, "vae", 0.5, reference


SCENARIOS = {"int8_vae": int8_vae, "vae_decode_process_fixes": vae_decode_process_fixes, "vae_decode": vae_decode, "vision_tower": vision_tower}


def music3_graphs(mutant, gguf_layer: bool = False) -> dict:
    """Music 3's AR loop with CUDA graphs emulated on the CPU (hotfix_testing/music3_support.py), a tiny real text
    encoder loaded by ComfyUI's ModelPatcher: the reference with graphs off, stock and pack with graphs on (seed 002:
    replays must read what graphs off computes; with ``gguf_layer`` a GGUF Q4_0 layer, which must not be captured)."""
    import comfy.model_prefetch
    import comfy.text_encoders.minimax_music as music

    from hotfix_testing.music3_support import emulated_graphs, generate, gguf_q4_0_down_proj, music3_text_encoder

    weight = gguf_q4_0_down_proj(WORK) if gguf_layer else None

    units = {"": "get_dynamic_vram__units", "-": None}.get(mutant.target_class, mutant.target_class)

    def run(graphs, enabled, with_pack):
        encoder = music3_text_encoder(music, weight, units)
        patcher = comfy.model_patcher.ModelPatcher(encoder, load_device=CPU, offload_device=CPU)
        attached = registry.attach_fixes(patcher, "clip") if with_pack else []
        comfy.model_management.load_models_gpu([patcher], force_full_load=True)
        try:
            return {"output": generate(encoder, graphs, enabled), "attached": attached}
        except Exception as exc:  # noqa: BLE001  (the outcome of the run is what is measured)
            return {"error": error_line(exc), "attached": attached}
        finally:
            comfy.model_management.unload_all_models()
            if with_pack:
                registry.detach_fixes(patcher, "clip")

    with emulated_graphs(comfy.model_prefetch) as graphs:
        reference = run(graphs, False, False)
        if "error" in reference:
            return {"invalid": f"the graphs-off reference run fails: {reference['error']}"}
        runs = {"stock": run(graphs, True, False), "pack": run(graphs, True, True)}
    return compared(runs, reference["output"])


def cuda_queries(mutant) -> dict:
    """Seed #15607 / #16365's question, as on an NVIDIA machine (kernels/cpu_device_cuda_query.py's view): the
    capability queries a text encoder on the CPU asks (``mutant.target_class``: the names, comma-separated, where the
    mutant renamed or added one) asked about the CPU; the reference is their answer on a machine without CUDA, the pack
    runs with the process-wide fixes installed."""
    from minimax_hotfix.kernels.cpu_device_cuda_query import on_machine, unguarded

    names = (mutant.target_class or "supports_fp8_compute,supports_nvfp4_compute,supports_mxfp8_compute").split(",")
    cpu = torch.device("cpu")

    def answers(nvidia, with_pack=False):
        installed = registry.install_process_fixes() if with_pack else []
        try:
            functions = [getattr(comfy.model_management, name) for name in names]
            if not with_pack:
                functions = [unguarded(function) for function in functions]
            return {"output": torch.tensor([bool(on_machine(f, nvidia)(cpu)) for f in functions]),
                    "attached": installed}
        except Exception as exc:  # noqa: BLE001  (the outcome of the run is what is measured)
            return {"error": error_line(exc), "attached": installed}
        finally:
            if with_pack:
                registry.uninstall_process_fixes()

    reference = answers(nvidia=False)
    if "error" in reference:
        return {"invalid": f"the answers without CUDA fail: {reference['error']}"}
    runs = {"stock": answers(nvidia=True), "pack": answers(nvidia=True, with_pack=True)}
    return compared(runs, reference["output"])


def transformers_tower(mutant) -> dict:
    """The seed of ``transformers_qwen3vl_pos_embed``: transformers' tiny Qwen3-VL vision tower on npu:0 with its
    ``pos_embed`` weight left in CPU RAM (a partial loader's), the pack through its public
    ``attach_to_transformers_model``, as a custom node calls it; the reference is the tower on the CPU."""
    from minimax_hotfix import api
    from minimax_hotfix.diagnostics.self_tests.transformers_qwen3vl_pos_embed import outputs, tiny_inputs, tiny_tower

    pixels, grid = tiny_inputs()

    def run(device, with_pack):
        tower = tiny_tower()
        if device != CPU:
            weight = tower.pos_embed.weight
            tower.to(device)
            tower.pos_embed.weight = weight
        attached = api.attach_to_transformers_model(tower) if with_pack else []
        try:
            with torch.inference_mode():
                result = tower(pixels.to(device), grid)
            return {"output": torch.cat([output.to(CPU).flatten() for output in outputs(result)]),
                    "attached": attached}
        except Exception as exc:  # noqa: BLE001  (the outcome of the run is what is measured)
            return {"error": error_line(exc), "attached": attached}
        finally:
            if with_pack:
                api.detach_from_transformers_model(tower)

    reference = run(CPU, False)
    if "error" in reference:
        return {"invalid": f"the CPU reference run fails: {reference['error']}"}
    return compared({"stock": run(NPU, False), "pack": run(NPU, True)}, reference["output"])


def h3_fp16(mutant) -> dict:
    """The seed of ``h3_fp16_overflow``: kernels/h3_fp16.py's tiny H3 DiT, whose activations leave fp16's range
    where the real model's do, computing in fp16 half resident (the rest cast per call, as in lowvram) through
    ComfyUI's ModelPatcher, stock and with the pack's model fixes (stock's NaN is the bug: black video, NaN audio). The reference is its fp32 run on the CPU; a
    run counts as the reference's output when it is at most as far from it as the bf16 run (the dtype ComfyUI
    computes H3 in where the device has bf16), in inference mode, as ComfyUI runs a prompt."""
    import comfy.ops

    from minimax_hotfix.kernels.h3_fp16 import tiny_h3_model, tiny_h3_outputs

    dit = importlib.import_module("comfy.ldm.minimax.model")
    model_class = getattr(dit, mutant.target_class or "MiniMaxH3Model")

    def build(dtype=torch.float16):
        return tiny_h3_model(model_class, comfy.ops.disable_weight_init, dtype, overflow=True)

    def on_cpu(dtype):
        return tiny_h3_outputs(build(dtype), dtype)

    with torch.inference_mode():
        try:
            reference = on_cpu(torch.float32)
            bf16_diff = (on_cpu(torch.bfloat16) - reference).abs().max().item()
        except Exception as exc:  # noqa: BLE001  (a mutant that breaks the core itself tests nothing)
            return {"invalid": f"the CPU reference run fails: {error_line(exc)}"}
        runs = stock_and_pack(build, lambda model, device: tiny_h3_outputs(model, torch.float16, device), "model", 0.5)
    return compared(runs, reference, tolerance=bf16_diff)


OWN_RUNS = {"h3_fp16": h3_fp16, "transformers_tower": transformers_tower, "cuda_queries": cuda_queries, "music3_graphs": music3_graphs, "music3_graphs_gguf": lambda mutant: music3_graphs(mutant, True)}


def main(argv):
    tree = Path(argv[0])
    for name in argv[1:]:
        print("MUTANT " + json.dumps(run_mutant(tree, mutated_cores.named(name))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
