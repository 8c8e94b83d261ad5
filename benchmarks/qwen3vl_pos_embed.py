"""Qwen3-VL vision pos-embed fixes: cost on a resident model (patched/unpatched, measured side by side in one run),
and what the ComfyUI fix takes off the CPU and the bus when pos_embed's weight sits in CPU RAM.

    .venv/bin/python benchmarks/qwen3vl_pos_embed.py                      # transformers tower
    COMFYUI_PATH=... <comfy venv>/bin/python benchmarks/qwen3vl_pos_embed.py   # + ComfyUI's tower

Resident: two copies of one tower on one device, one patched; calls alternate and the ratio is the median of
the per-pair ratios (robust to load from other processes on a shared machine). Offloaded: H3 text encoder sizes
(2304 x 1152 table, 1024x1024 reference image = 64x64 patches); the CPU time is the stock interpolation the fix
moves to the compute device.
"""

import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # run by path: tools/minimax_hotfix is the pack (docs/testing.md, "How the tests import the pack")

PAIRS = 80


def fastest_ms(call, rounds=7):
    call()
    return min(_timed(call) for _ in range(rounds)) * 1e3


def _timed(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def side_by_side(stock_call, patched_call):
    """Alternating calls, (stock, patched) then (patched, stock): the ratio is the median of the pairs' ratios,
    so load from other processes, which changes slowly, hits both members of a pair alike."""
    stock_call(), patched_call()
    ratios, stock_times = [], []
    for i in range(PAIRS):
        if i % 2:
            patched, stock = _timed(patched_call), _timed(stock_call)
        else:
            stock, patched = _timed(stock_call), _timed(patched_call)
        ratios.append(patched / stock)
        stock_times.append(stock)
    return min(stock_times) * 1e3, statistics.median(ratios)


def _no_grad(tower, pixels, grid):
    with torch.no_grad():
        tower(pixels, grid)


def report_resident(name: str, tower, attach) -> None:
    """Print patched/unpatched for ``tower`` (hidden 256, depth 2) resident on the CPU, one 16x16-patch image:
    a deep copy with the fix attached by ``attach`` runs side by side with the original."""
    grid = torch.tensor([[1, 16, 16]])
    pixels = torch.randn(16 * 16, 3 * 2 * 16 * 16)
    patched_tower = copy.deepcopy(tower)
    attach(patched_tower)
    stock_ms, ratio = side_by_side(lambda: _no_grad(tower, pixels, grid), lambda: _no_grad(patched_tower, pixels, grid))
    print(f"{name} Qwen3VLVisionModel, resident on cpu (hidden 256, depth 2, {len(pixels)} patches, "
          f"{stock_ms:.1f} ms a call): patched/unpatched {ratio:.4f}")


def transformers_resident():
    import transformers
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from minimax_hotfix import api

    config = Qwen3VLVisionConfig(depth=2, hidden_size=256, intermediate_size=512, num_heads=4, in_channels=3,
                                 patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=256,
                                 num_position_embeddings=2304, deepstack_visual_indexes=[0])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = Qwen3VLVisionModel(config).eval()
    report_resident(f"transformers {transformers.__version__}", tower, api.attach_to_transformers_model)


def comfyui_resident_and_offloaded():
    import comfy.ops
    from comfy.text_encoders.qwen3vl import QWEN3VL_VISION, QWEN3VL_VISION_COMMON, Qwen3VLVisionModel

    from minimax_hotfix.patches import qwen3vl_pos_embed as fix

    config = {**QWEN3VL_VISION_COMMON, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "depth": 2,
              "out_hidden_size": 256, "deepstack_visual_indexes": [0]}
    torch.manual_seed(0)
    tower = Qwen3VLVisionModel(config, dtype=torch.float32, ops=comfy.ops.manual_cast)
    for parameter in tower.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    report_resident("ComfyUI", tower, fix.hook_towers)

    h3 = {**QWEN3VL_VISION_COMMON, **QWEN3VL_VISION["qwen3vl_32b"], "out_hidden_size": 64, "depth": 0,
          "deepstack_visual_indexes": []}
    image = torch.tensor([[1, 64, 64]])
    patches = 64 * 64
    for dtype in (torch.bfloat16, torch.float32):
        with torch.device("meta"):
            offloaded = Qwen3VLVisionModel(h3, dtype=dtype, ops=comfy.ops.manual_cast)
        offloaded.pos_embed.weight = torch.nn.Parameter(torch.randn(2304, 1152).to(dtype), requires_grad=False)
        lowvram = fastest_ms(lambda offloaded=offloaded: offloaded.fast_pos_embed_interpolate(image))
        offloaded.pos_embed._v = object()  # dynamic VRAM: a vbar module fed a CPU input clones its weight
        dynamic = fastest_ms(lambda offloaded=offloaded: offloaded.fast_pos_embed_interpolate(image))
        size = dtype.itemsize
        print(f"ComfyUI H3 position table, pos_embed {str(dtype)[6:]} in CPU RAM, 1024x1024 image: stock CPU "
              f"interpolation {lowvram:.1f} ms (lowvram offload), {dynamic:.1f} ms (dynamic VRAM, incl. the table "
              f"clone); stock then sends the {patches * 1152 * size / 1e6:.1f} MB result to the GPU on every call. "
              f"The fix makes the {2304 * 1152 * size / 1e6:.1f} MB table resident once and interpolates there")


def comfyui_bytes_per_forward():
    """Host-to-device bytes per forward of ComfyUI's tower at the H3 text encoder's vision width (1152, depth 1, no
    weight resident: every weight in CPU RAM, the compute device meta), stock and patched side by side, per image
    size: the first forward and each later one (weights included, as a partial load with nothing resident sends
    them every time). "pack" is both Qwen3-VL table fixes, as the pack's CLIP loader attaches them."""
    import comfy.ops
    from comfy.text_encoders.qwen3vl import QWEN3VL_VISION, QWEN3VL_VISION_COMMON, Qwen3VLVisionModel

    from minimax_hotfix.benchmarks._host_to_meta import HostToMeta
    from minimax_hotfix.patches import qwen3vl_pos_embed, qwen3vl_rotary_table

    config = {**QWEN3VL_VISION_COMMON, **QWEN3VL_VISION["qwen3vl_32b"], "depth": 1, "deepstack_visual_indexes": [],
              "out_hidden_size": 1152}
    torch.manual_seed(0)
    stock = Qwen3VLVisionModel(config, dtype=torch.float32, ops=comfy.ops.manual_cast)
    patched = copy.deepcopy(stock)
    qwen3vl_pos_embed.hook_towers(patched)
    qwen3vl_rotary_table.hook_towers(patched)

    def sent_mb(tower, side):
        pixels = torch.zeros(side * side, 3 * 2 * 16 * 16, device="meta")
        with torch.inference_mode(), HostToMeta() as counter:
            tower(pixels, torch.tensor([[1, side, side]]))
        return counter.bytes / 1e6

    print("ComfyUI H3 vision tower (width 1152, depth 1, merger out 1152, fp32, no weight resident), host-to-device MB per forward:")
    print(f"{'image':>10} {'forward':>8} {'stock':>9} {'pack':>9} {'pack/stock':>10}")
    for side, name in ((32, "512x512"), (48, "768x768"), (64, "1024x1024"), (32, "512x512")):
        for forward in ("first", "later"):
            stock_mb, pack_mb = sent_mb(stock, side), sent_mb(patched, side)
            print(f"{name:>10} {forward:>8} {stock_mb:9.2f} {pack_mb:9.2f} {pack_mb / stock_mb:10.3f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    transformers_resident()
    from minimax_hotfix.diagnostics.comfyui_checkout import use_comfyui_checkout

    if use_comfyui_checkout() is None:
        print("ComfyUI tower: skipped (set COMFYUI_PATH)")
    else:
        comfyui_resident_and_offloaded()
        comfyui_bytes_per_forward()
