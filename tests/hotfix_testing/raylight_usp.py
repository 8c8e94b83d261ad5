"""One rank of raylight's MiniMax H3 sequence parallelism on the CPU, with and without the pack's fix:

    python -m hotfix_testing.raylight_usp RANK WORLD PORT OUT_DIR

run by tests/test_raylight_usp.py, one process per rank, with raylight's source (a copy of ``../shared/raylight``),
ComfyUI, the pack (tools/) and tests/ on the path. Each rank writes ``OUT_DIR/rank<RANK>.pt``: {case: the tiny
overflowing H3's outputs flattened, or the error it raised} and {case: what each injection left in place}.

What runs for real: raylight's ``initialize_xfuser_parallel`` (xfuser 0.4.5's parallel state through raylight's
minimal xfuser), its USP injection for MiniMax H3 (``distributed_modules/usp.py``: ``_inject_minimax_h3`` as the
ON_LOAD callback ``USPInjectRegistry.inject``), its ``usp_dit_forward`` / ``usp_attn_forward`` with Ulysses attention
(yunchang's all-to-all over the sequence-parallel group, torch's math attention), its FSDP sharding
(``comfy_dist/fsdp_utils.fully_shard_bottom_up``, torch's ``fully_shard``), and ComfyUI's ModelPatcher load. Stubbed,
each because it needs CUDA or NCCL:

* NCCL: the process group is gloo (raylight's ``RayWorker`` opens it with NCCL before xfuser's setup, which then
  keeps it), and xfuser's backend and device answer gloo and the CPU (``xfuser.envs``: with torch built for CUDA it
  answers NCCL and ``cuda:RANK`` on any machine);
* CUDA: ``torch.cuda.is_available`` answers yes while raylight is imported: xfuser's attention layer imports its
  implementation (yunchang's ``LongContextAttention``) only where CUDA or an NPU is present;
* the FSDP device mesh is a CPU one (raylight's is ``init_device_mesh("cuda", ...)``).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

ULYSSES_ATTENTION = "TORCH_MATH"  # yunchang's attention kernel that runs on a CPU (raylight's default needs flash)


def import_raylight():
    """raylight's package, imported as raylight's __init__ does it (its minimal xfuser), with the stubs above."""
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        import raylight
    finally:
        torch.cuda.is_available = real
    envs = sys.modules["xfuser.envs"]
    envs.get_torch_distributed_backend = lambda: "gloo"
    envs.get_device = lambda local_rank: torch.device("cpu")
    return raylight


def step_inputs(dtype: torch.dtype) -> dict:
    """The tiny H3's inputs in ``dtype``, with the packed layout that ComfyUI's ``extra_conds`` builds once per run
    (raylight's forward builds it only with a keyword the 0.33.0 layout lacks)."""
    from comfy.ldm.minimax.model import PackedLayout

    from minimax_hotfix.kernels.h3_fp16 import tiny_h3_inputs

    inputs = tiny_h3_inputs(dtype)
    video, audio = inputs["x"]
    layout = PackedLayout(inputs["context"].shape[1], video.shape[2], video.shape[3], video.shape[4], audio.shape[-1])
    return {**inputs, "minimax_payload": {"layout": layout}}


def tiny_dit():
    """The tiny overflowing H3 as ComfyUI builds it on a device without bf16: fp32 weights, cast per call."""
    import comfy.ops

    from minimax_hotfix.kernels.h3_fp16 import tiny_h3_model
    from minimax_hotfix.patches.h3_fp16_overflow import h3_model_class

    return tiny_h3_model(h3_model_class(), comfy.ops.manual_cast, torch.float32, overflow=True)


def outputs(dit, dtype: torch.dtype) -> torch.Tensor:
    from hotfix_testing.h3_forms import dit_call

    return dit_call(dit, step_inputs(dtype))


def in_place(dit) -> dict:
    """What each side's injection left on the DiT: raylight's parallel forward and attention, the pack's overrides."""
    from raylight.diffusion_models.minimax.xdit_context_parallel import usp_attn_forward, usp_dit_forward

    return {"raylight forward": getattr(dit._forward, "__func__", None) is usp_dit_forward,
            "raylight attention": all(getattr(block.attn.forward, "__func__", None) is usp_attn_forward
                                      for block in dit.blocks),
            "pack entry": "forward" in vars(dit),
            "pack blocks": all("forward" in vars(block) for block in dit.blocks)}


def as_base_model(dit):
    """``dit`` inside the model class raylight's registry dispatches on (``model_base.MiniMaxH3``)."""
    import comfy.model_base

    base = comfy.model_base.MiniMaxH3.__new__(comfy.model_base.MiniMaxH3)
    torch.nn.Module.__init__(base)
    base.diffusion_model = dit
    return base


def usp_inject(dit) -> None:
    """raylight's ON_LOAD callback (``RayWorker.patch_usp``), on a patcher-like holder of the model."""
    from raylight.distributed_modules.usp import USPInjectRegistry

    holder = type("Patcher", (), {"model": as_base_model(dit)})()
    USPInjectRegistry.inject(holder, torch.device("cpu"), 0, False, True)


def pack_inject(dit) -> None:
    from minimax_hotfix.patches.h3_fp16_overflow import FIX, hook_dit

    hook_dit(dit, FIX)


def fsdp_shard(dit, world: int) -> None:
    """raylight's FSDP sharding of the DiT (``fully_shard_bottom_up``) over a CPU mesh."""
    from raylight.comfy_dist.fsdp_utils import fully_shard_bottom_up
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard_bottom_up(dit, {"mesh": init_device_mesh("cpu", (world,))}, native_ignore_scale=False)


def through_comfyui(dtype: torch.dtype, reinject: bool) -> tuple[torch.Tensor, dict]:
    """The DiT through ComfyUI's ModelPatcher as a raylight actor holds it: raylight's USP as the ON_LOAD callback
    (``RayWorker.patch_usp``), the pack attached by its registry, ComfyUI's own load (the callback, then the
    injections); with ``reinject``, raylight's callback once more on the injected model, as a reload does."""
    import comfy.model_management
    import comfy.patcher_extension
    import comfy.sd
    from raylight.distributed_modules.usp import USPInjectRegistry

    from minimax_hotfix import registry
    from minimax_hotfix.contract import Target

    patcher = comfy.sd.load_diffusion_model_state_dict(tiny_dit().state_dict())
    if dtype != torch.float32:
        patcher.set_model_compute_dtype(dtype)
    patcher.add_callback(comfy.patcher_extension.CallbacksMP.ON_LOAD, USPInjectRegistry.inject)
    attached = registry.attach_fixes(patcher, Target.MODEL)
    comfy.model_management.load_models_gpu([patcher])
    dit = patcher.model.diffusion_model
    if reinject:
        USPInjectRegistry.inject(patcher, torch.device("cpu"), 0, False, True)
    return outputs(dit, dtype), {**in_place(dit), "pack attached": "h3_fp16_overflow" in attached}


def cases(world: int) -> dict:
    """{case: (run it, giving the outputs and what stayed in place)}."""
    def direct(order: tuple, dtype: torch.dtype, fsdp: bool = False):
        def run():
            dit = tiny_dit()
            if fsdp:
                fsdp_shard(dit, world)
            for inject in order:
                inject(dit)
            return outputs(dit, dtype), in_place(dit)
        return run

    found = {}
    for dtype in (torch.float16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        found[f"raylight alone, {name}"] = direct((usp_inject,), dtype)
        found[f"raylight, then the pack, {name}"] = direct((usp_inject, pack_inject), dtype)
        found[f"the pack, then raylight, {name}"] = direct((pack_inject, usp_inject), dtype)
    found["FSDP, raylight alone, float16"] = direct((usp_inject,), torch.float16, fsdp=True)
    found["FSDP, the pack, then raylight, float16"] = direct((pack_inject, usp_inject), torch.float16, fsdp=True)
    found["ComfyUI's load, float16"] = lambda: through_comfyui(torch.float16, reinject=False)
    found["ComfyUI's load, raylight reinjected, float16"] = lambda: through_comfyui(torch.float16, reinject=True)
    return found


def main(argv) -> int:
    rank, world, port, out_dir = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    from minimax_hotfix.diagnostics.comfyui_checkout import use_comfyui_checkout

    use_comfyui_checkout()
    import_raylight()
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    from raylight.distributed_worker.parallel_group_manager import initialize_xfuser_parallel

    initialize_xfuser_parallel(rank, world, {"is_xdit": True, "ulysses_degree": world, "attention": ULYSSES_ATTENTION,
                                             "sync_ulysses": False})
    results, placed = {}, {}
    for name, run in cases(world).items():
        try:
            results[name], placed[name] = run()
        except Exception:
            results[name] = traceback.format_exc(limit=-3)
    torch.save({"outputs": results, "in_place": placed}, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
