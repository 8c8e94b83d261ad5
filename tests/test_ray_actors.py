"""The pack's fixes inside raylight's Ray actors (registry/ray_actors.py), on a local Ray cluster of CPU actors.

What runs for real: Ray (PyPI's ``ray``: its cloudpickle, actor processes whose runtime environment holds raylight and
ComfyUI's root, not the pack nor this file's folder), raylight's own code (a copy of ``../shared/raylight``):
``RayWorker.load_unet`` (its non-FSDP path, as ``RayUNETLoader`` calls it), its hooks ``model_function_runner`` and
``model_function_runner_get_values``, its ``ray_patch`` decorator through its ``RayModelComputeDtype`` node (which
forces each actor's H3 into fp16, as a user without bf16 would), the pack loaded the way ComfyUI loads a custom node
(its modules named by its folder's path) and its Apply node, ComfyUI 0.33.0 in each actor and MiniMax H3's DiT.
Stand-in: ``RayWorker``'s constructor, which needs a CUDA device and opens an NCCL group: ``RaylightWorker`` builds a
RayWorker without it, sets the fields its load path reads, and hands each call to raylight's own method.

Red controls: without the Apply node an actor's fp16 H3 gives NaN; pickled by reference (no
``register_pickle_by_value``), the pack's function fails in a fresh actor with ModuleNotFoundError.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path

import pytest
import torch

from hotfix_testing import raylight_source

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(not raylight_source.available(), reason="needs ../shared/raylight (raylight's source)")

ROOT = Path(__file__).resolve().parents[1]
ACTORS = 2
# what RayWorker.load_unet reads of a worker that RayInitializer set up for plain (non-FSDP, non-xDiT) sharing
NON_FSDP_WORKER = {"model": None, "state_dict": None, "vae_model": None, "cached_controlnet": None, "lora_list": None,
                   "cached_base_model": None, "cached_base_key": None, "active_request_key": None,
                   "overwrite_cast_dtype": None, "is_model_loaded": False, "local_rank": 0, "xfuser_parallel": None,
                   "parallel_dict": {"is_fsdp": False, "is_xdit": False, "use_mmap": False, "is_quant": False,
                                     "pipefusion_enabled": False}}


class RaylightWorker:
    """raylight's RayWorker without its constructor (see the module docstring); every call is raylight's method."""

    def __init__(self, dit_file: str):
        from raylight.distributed_worker.ray_worker import RayWorker

        self.worker = RayWorker.__new__(RayWorker)
        vars(self.worker).update(NON_FSDP_WORKER)
        self.worker.load_unet(dit_file, {})

    def model_function_runner(self, fn, *args, **kwargs):
        return self.worker.model_function_runner(fn, *args, **kwargs)

    def model_function_runner_get_values(self, fn, *args, **kwargs):
        return self.worker.model_function_runner_get_values(fn, *args, **kwargs)


def in_cpu_mode():
    """Each Ray worker process, before any actor: ComfyUI in CPU mode (no GPU here), as the tests' own ComfyUI. Ray
    puts the driver's folder on its workers' path; a user's is ComfyUI's root, this run's the pack's, whose ``nodes``
    package would stand in for ComfyUI's ``nodes`` module (which raylight's nodes import): ComfyUI's is imported
    first, with the pack's folder off the path."""
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]
    from comfy.cli_args import args

    args.cpu = True
    importlib.import_module("nodes")


def run_dit(patcher, inputs: dict) -> torch.Tensor:
    """One forward of the patcher's DiT as ComfyUI runs it (loaded through model management, inputs in its compute
    dtype), outputs flattened into one fp32 vector."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([patcher])
    model = patcher.model
    dtype = model.get_dtype_inference()
    inputs = {**inputs, "x": [part.to(dtype) for part in inputs["x"]], "context": inputs["context"].to(dtype)}
    with torch.no_grad():
        return torch.cat([part.reshape(-1).float() for part in model.diffusion_model(**inputs)])


@pytest.fixture(scope="module")
def pack_nodes(comfyui):
    """ComfyUI's node registry with the pack loaded into it as ComfyUI loads a custom node."""
    import nodes

    stock = set(nodes.NODE_CLASS_MAPPINGS)
    assert asyncio.run(nodes.load_custom_node(str(ROOT), ignore=stock)), "ComfyUI failed to load the pack"
    yield nodes
    sys.modules[nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixStatus"].__module__].registry.uninstall_process_fixes()


@pytest.fixture(scope="module")
def dit_file(comfyui, tmp_path_factory) -> Path:
    """The tiny overflowing H3 DiT as a safetensors file."""
    import comfy.ops
    from safetensors.torch import save_file

    from minimax_hotfix.kernels.h3_fp16 import tiny_h3_model
    from minimax_hotfix.patches.h3_fp16_overflow import h3_model_class

    model = tiny_h3_model(h3_model_class(), comfy.ops.disable_weight_init, torch.float32, overflow=True)
    path = tmp_path_factory.mktemp("ray_dit") / "minimax_h3_tiny_overflow.safetensors"
    save_file({key: value.contiguous() for key, value in model.state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="module")
def raylight(comfyui, tmp_path_factory) -> Path:
    """raylight copied into a folder of its own, importable here (its nodes run in this process, as in ComfyUI's)."""
    folder = raylight_source.copy_package(tmp_path_factory.mktemp("raylight"))
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def cluster(comfyui, raylight):
    """A local Ray cluster of CPU actors whose runtime environment holds raylight and ComfyUI's root; this test
    module goes to them by value (they cannot import it)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=ACTORS + 1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{raylight}:{comfyui}"}, "worker_process_setup_hook": in_cpu_mode})
    yield
    ray.shutdown()


def start_actors(count: int, dit_file: Path) -> list:
    worker = ray.remote(num_cpus=1)(RaylightWorker)
    return [worker.remote(str(dit_file)) for _ in range(count)]


def actor_outputs(actors: list, inputs: dict) -> list[torch.Tensor]:
    return ray.get([actor.model_function_runner_get_values.remote(run_dit, inputs) for actor in actors])


def shipping_module(pack_nodes):
    """The pack's registry/ray_actors.py as ComfyUI named it (beside the pack's nodes package)."""
    package = pack_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixApplyRayActors"].__module__.rsplit(".", 1)[0]
    return importlib.import_module(f"{package}.registry.ray_actors")


def test_a_fresh_actor_cannot_import_the_pack_by_reference(cluster, pack_nodes, dit_file):
    """Red control of the pickling: ComfyUI names the pack's modules by its folder's path, so the function that
    attaches the fixes, pickled by reference, fails to import in an actor."""
    from ray import cloudpickle

    shipping = shipping_module(pack_nodes)
    assert shipping.__name__.startswith(str(ROOT))  # a module named by the pack's path
    if shipping.__name__ in cloudpickle.list_registry_pickle_by_value():
        cloudpickle.unregister_pickle_by_value(shipping)
    (actor,) = start_actors(1, dit_file)
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(actor.model_function_runner_get_values.remote(shipping.attach_in_actor, shipping.pack_sources()))
    print(f"\nby reference, in a fresh actor: {str(raised.value).splitlines()[-1]}")
    assert "ModuleNotFoundError" in str(raised.value)
    ray.kill(actor)


def test_the_apply_node_attaches_the_fixes_in_every_actor(cluster, pack_nodes, dit_file):
    """Red: each actor's fp16 H3 gives NaN before the Apply node. Green: after it, every actor reports the fixes
    attached and its output equals the same DiT file run in this process through the pack's Apply node, bit for
    bit (same CPU, same code)."""
    import comfy.sd
    from raylight.comfy_extra_dist.nodes_model_advanced import RayModelComputeDtype

    from minimax_hotfix.kernels.h3_fp16 import tiny_h3_inputs

    inputs = tiny_h3_inputs(torch.float32)
    actors = start_actors(ACTORS, dit_file)
    ray_actors = {"workers": actors}
    assert RayModelComputeDtype().patch(ray_actors, "fp16") == (ray_actors,)  # raylight's node: fp16 in every actor
    stock = actor_outputs(actors, inputs)
    assert all(not torch.isfinite(out).all() for out in stock), "the actors' fp16 H3 came out finite without the pack"

    node = pack_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixApplyRayActors"]()
    assert node.apply(ray_actors=ray_actors) == (ray_actors,)
    reports = ray.get([actor.model_function_runner_get_values.remote(
        lambda patcher: sorted(patcher.injections)) for actor in actors])
    fixed = actor_outputs(actors, inputs)

    local = comfy.sd.load_diffusion_model(str(dit_file))
    local.set_model_compute_dtype(torch.float16)
    (applied,) = pack_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixApplyModel"]().apply(model=local)
    reference = run_dit(applied, inputs)
    print(f"\nactors' injection keys: {reports}; |actor - this process| "
          f"{[(out - reference).abs().max().item() for out in fixed]}")
    assert all("minimax_hotfix.h3_fp16_overflow" in keys for keys in reports)
    last_run = shipping_module(pack_nodes).LAST_RUN.describe()  # the Status node's and the doctor's raylight row
    assert last_run.startswith(f"last run: {ACTORS} Ray actor(s): cpu: h3_fp16_overflow") \
        and last_run.count("H3 in float16") == ACTORS, last_run
    assert torch.isfinite(reference).all()
    assert all(torch.equal(out, reference) for out in fixed)
    for actor in actors:
        ray.kill(actor)
