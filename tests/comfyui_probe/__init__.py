"""Test-only ComfyUI custom node, placed in a temporary ComfyUI's custom_nodes by the workflow run tests.

* Makes ComfyUI build the tiny configurations the synthetic model files were written for
  (``synthetic_models.TINY_CONFIGS``, with the changes of the models folder's ``TINY_CONFIGS_FILE``: ComfyUI
  hard-codes those models' sizes) before any loader builds a model.
* ``TestProbeSaveTensors`` writes the tensors of its inputs to the output folder, so that a test compares runs
  bit for bit rather than through lossy encoders.
* ``TestProbeFixedLatent`` gives a latent of the input's shape (the last part of a nested one: MiniMax H3's audio)
  with fixed values, so that a decoder is compared on the same input on every device, whatever the sampling before
  it computed.
* ``POST /probe/unload_models`` ``{"free_memory": bool}``: what the ``/free`` route asks of the prompt worker,
  returned once the worker has taken the request, so the next prompt starts with nothing loaded.
* ``POST /probe/load_args`` ``{"fp16_unet": bool, "disable_cuda_graphs": bool}``: a command-line option that
  ComfyUI reads only when it loads a model or runs it (``LOAD_ARGS``), set on the running server: what runs after it
  runs as in a server started with (or without) that option, so that one server shows both.
* ``GET /probe/music3_generate``: each Music 3 AR loop (``MiniMaxMusic3AR.generate``) since the last request: its
  seconds, frames, the graph units it captured (CUDA: ``comfy.model_prefetch.GRAPH_MODULES`` before ComfyUI's
  clean-up after the node; the emulation's on the CPU) and the units it started without a capture mark
  (``_v_block`` None: not streamed by the load, or left uncaptured by the pack's capture policy).
* ``POST /probe/trace`` ``{"on": bool}``: on, every module call in the server from then on records its class and
  its output's shape, L1 norm and largest magnitude (a forward hook on every module); off, the hook is removed and the
  calls are returned, so that a run on a GPU and one on the CPU name the first module whose output parts
  (benchmarks/gpu_check.py, ``first_divergence``).
* With ``EMULATED_GRAPHS_ENV`` set, the server's Music 3 AR loop runs on the emulated CUDA graphs
  (tests/hotfix_testing/emulated_graphs.py) under the emulated capture rules, so that a CPU or simulated-device
  server shows what graphs do: the stale replay's noise, and the capture error of a unit that copies from the host.
* ``POST /probe/reserve_vram`` ``{"gb": float}``: ``--reserve-vram`` set on the running server (ComfyUI reads it at
  every load, through ``minimum_inference_memory()``), so that one server on a real GPU serves every budget
  (benchmarks/gpu_check.py).
* With ``PINNED_FREE_MEMORY_ENV`` set, ComfyUI reads the GPU's free memory as if the server were alone on it
  (tests/hotfix_testing/pinned_free_memory.py), so that the GPU check's servers side by side keep their budgets.
* ``POST /probe/apply_model_chooses_on_its_input`` ``{"on": bool}``: on, the pack's ``MiniMaxHotfixApplyModel`` also
  makes the fixes' load-time choices (``Fix.on_own_patcher``: H3's compute dtype) on the patcher it is handed, the
  upstream loader's cached one, as a pack that sets the dtype on its input does; off, the node as shipped. The red
  control of the cached-patcher sequence (tests/test_h3_fp16_on_device.py).
"""

import asyncio
import contextlib
import functools
import gc
import importlib.util
import os
import sys
import time
from pathlib import Path

import folder_paths
import server
import torch
from aiohttp import web
from comfy.cli_args import args
from safetensors.torch import save_file


# loaded from its file: the server's path holds ComfyUI, not the tests (tests/hotfix_testing/synthetic_models.py)
def _testing_module(name: str):
    spec = importlib.util.spec_from_file_location(
        f"minimax_hotfix_test_{name}", Path(__file__).resolve().parents[1] / "hotfix_testing" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


synthetic_models = _testing_module("synthetic_models")
emulated_graphs = _testing_module("emulated_graphs")
pinned_free_memory = _testing_module("pinned_free_memory")
pack_modules = _testing_module("pack_modules")
for _patcher in synthetic_models.tiny_config_patches(Path(folder_paths.models_dir)):
    _patcher.start()
pinned_free_memory.pin_where_asked(torch.cuda)

class TestProbeSaveTensors:
    CATEGORY = "testing"
    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"filename": ("STRING", {"default": "probe"})},
                "optional": {"conditioning": ("CONDITIONING",), "latent": ("LATENT",), "audio": ("AUDIO",),
                             "sigmas": ("SIGMAS",), "images": ("IMAGE",)}}

    def save(self, filename, conditioning=None, latent=None, audio=None, sigmas=None, images=None):
        tensors = {}
        if conditioning is not None:
            tensors["conditioning"] = conditioning[0][0]
        if latent is not None:
            samples = latent["samples"]
            if samples.is_nested:  # MiniMax H3: (video, audio)
                tensors.update({f"latent_{index}": part for index, part in enumerate(samples.unbind())})
            else:
                tensors["latent"] = samples
        if audio is not None:
            tensors["audio"] = audio["waveform"]
        if sigmas is not None:
            tensors["sigmas"] = sigmas
        if images is not None:
            tensors["images"] = images
        os.makedirs(folder_paths.get_output_directory(), exist_ok=True)
        path = os.path.join(folder_paths.get_output_directory(), f"{filename}.safetensors")
        save_file({name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in tensors.items()},
                  path)
        return {"ui": {"probe": [{"filename": os.path.basename(path)}]}}


class TestProbeFixedLatent:
    CATEGORY = "testing"
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "fixed"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latent": ("LATENT",)}}

    def fixed(self, latent):
        samples = latent["samples"]
        shape = (samples.unbind()[-1] if samples.is_nested else samples).shape
        return ({"samples": torch.randn(shape, generator=torch.Generator().manual_seed(0))},)


@server.PromptServer.instance.routes.post("/probe/unload_models")
async def unload_models(request):
    # A failed prompt's traceback keeps its models alive in reference cycles. Collected inside ComfyUI's free_memory
    # loop, their finalizer (cleanup_models) shortens current_loaded_models under the loop's cached indices: IndexError,
    # and the prompt worker thread dies (Comfy-Org/ComfyUI#14365). Collected here, before the worker unloads, it cannot.
    gc.collect()
    queue = server.PromptServer.instance.prompt_queue
    flags = ["unload_models"] + (["free_memory"] if (await request.json()).get("free_memory") else [])
    for name in flags:
        queue.set_flag(name, True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        if not any(name in queue.get_flags(reset=False) for name in flags):
            return web.json_response({"taken": True})
        with queue.mutex:  # a notify reaches the worker only while it waits on the queue: again until it is taken
            queue.not_empty.notify()
    return web.json_response({"taken": False}, status=504)


# ComfyUI's options (``comfy.cli_args.args``) read at each model load or run and nowhere at start-up: ``--fp16-unet``
# by ``comfy.model_management.unet_dtype`` alone, ``--disable-cuda-graphs`` at each ``prefetch_queue_pop``
LOAD_ARGS = {"fp16_unet", "disable_cuda_graphs"}


@server.PromptServer.instance.routes.post("/probe/load_args")
async def set_load_args(request):
    body = await request.json()
    if not set(body) <= LOAD_ARGS:
        return web.json_response({"not read at load or run": sorted(set(body) - LOAD_ARGS)}, status=400)
    for name, value in body.items():
        setattr(args, name, bool(value))
    return web.json_response({name: getattr(args, name) for name in body})


@server.PromptServer.instance.routes.post("/probe/reserve_vram")
async def set_reserve_vram(request):
    import comfy.model_management

    gb = float((await request.json())["gb"])
    comfy.model_management.EXTRA_RESERVED_VRAM = gb * 1024**3
    return web.json_response({"reserved_mb": comfy.model_management.extra_reserved_memory() / 1024**2})


def _record_music3_generate():
    """Wraps ``MiniMaxMusic3AR.generate`` (where this core has Music 3) to record each AR loop; with
    EMULATED_GRAPHS_ENV, runs it on the emulated graphs, dropped after each loop as ComfyUI drops its graphs, each
    capture under the emulated capture rules (a host copy raises CUDA's error; the pack's own rules, loaded without
    the pack). The units are those ComfyUI's dynamic VRAM load marked (``_v_block``), as on a CUDA machine."""
    try:
        import comfy.ldm.minimax_music.ar as ar
        import comfy.model_prefetch as prefetch
    except ImportError:
        return
    emulated = os.environ.get(emulated_graphs.EMULATED_GRAPHS_ENV) == "1"
    capture_rules = functools.partial(pack_modules.pack_module("diagnostics.emulated_capture").emulated_capture,
                                      host_data_is_copy=True)
    emulation = None
    generate = ar.MiniMaxMusic3AR.generate

    @functools.wraps(generate)
    def recorded(self, *call_args, **kwargs):
        nonlocal emulation
        if emulated:
            if emulation is None:  # at the first loop: the pack has read the real code at start-up by then
                emulation = SERVER_LIFETIME.enter_context(emulated_graphs.emulated_graph_path(prefetch, capture_rules))
            emulation.enabled = not args.disable_cuda_graphs
            emulation.reset()
        roots = [unit[0] if isinstance(unit, (list, tuple)) else unit
                 for group in getattr(self, "get_dynamic_vram__units", lambda: ())() for unit in group]
        started = time.perf_counter()
        frames = generate(self, *call_args, **kwargs)
        seconds = time.perf_counter() - started  # generate returns its frames on the CPU: the device has finished
        units = len(emulation.graphs) if emulation is not None else len(getattr(prefetch, "GRAPH_MODULES", ()))
        MUSIC3_GENERATE.append({"seconds": seconds, "frames": int(frames.shape[0]), "graph_units": units,
                                "unmarked_units": sum(getattr(root, "_v_block", None) is None for root in roots),
                                "graphs": not args.disable_cuda_graphs})
        return frames

    ar.MiniMaxMusic3AR.generate = recorded


MUSIC3_GENERATE = []
SERVER_LIFETIME = contextlib.ExitStack()  # what the probe keeps entered for as long as the server runs
_record_music3_generate()


@server.PromptServer.instance.routes.get("/probe/music3_generate")
async def music3_generate(request):
    records = list(MUSIC3_GENERATE)
    del MUSIC3_GENERATE[:len(records)]
    return web.json_response(records)


def _fingerprint(module, inputs, output):
    tensor = output if isinstance(output, torch.Tensor) else next(
        (value for value in (output if isinstance(output, (list, tuple)) else ()) if isinstance(value, torch.Tensor)),
        None)
    if tensor is None or not tensor.is_floating_point() or tensor.is_nested or tensor.numel() == 0:
        return
    values = tensor.detach().double()
    TRACE["calls"].append([f"{type(module).__module__}.{type(module).__qualname__}", list(tensor.shape),
                           values.abs().sum().item(), values.abs().max().item()])


TRACE = {"hook": None, "calls": []}


@server.PromptServer.instance.routes.post("/probe/trace")
async def trace(request):
    on = bool((await request.json())["on"])
    if TRACE["hook"] is not None:
        TRACE["hook"].remove()
        TRACE["hook"] = None
    calls, TRACE["calls"] = TRACE["calls"], []
    if on:
        TRACE["hook"] = torch.nn.modules.module.register_module_forward_hook(_fingerprint)
    return web.json_response({"calls": calls})


@server.PromptServer.instance.routes.post("/probe/apply_model_chooses_on_its_input")
async def apply_model_chooses_on_its_input(request):
    import nodes

    on = bool((await request.json())["on"])
    node = nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixApplyModel"]
    if "apply" in vars(node):  # the probe's: the node's own is its base class's
        delattr(node, "apply")
    if on:
        registry = sys.modules[node.__module__].registry
        shipped = node.apply

        def apply_choosing_on_its_input(self, **inputs):
            for fix in registry.fixes_for(self.TARGET):
                fix.on_own_patcher(inputs[self.TARGET.value])
            return shipped(self, **inputs)

        node.apply = apply_choosing_on_its_input
    return web.json_response({"on": on})


NODE_CLASS_MAPPINGS = {"TestProbeSaveTensors": TestProbeSaveTensors, "TestProbeFixedLatent": TestProbeFixedLatent}
