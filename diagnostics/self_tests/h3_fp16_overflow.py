"""Self-test of h3_fp16_overflow: a tiny ComfyUI H3 DiT whose activations leave fp16's range where the real model's do
(condition_proj, an attention-sink row growing through the blocks, out_proj and fc2), on the accelerator where there
is one, else on the CPU. Without the fix in fp16 its output is not finite (red: the users' black video, NaN audio);
with it the output is finite and at least as close to the fp32 run as the bf16 path's, bf16 and fp32 are bit for
bit stock, and the branch rescale is exact (green)."""

from __future__ import annotations

import torch

from ...contract import Check, remove_handles
from ...kernels.h3_fp16 import BRANCH_RESCALE, tiny_h3_model, tiny_h3_outputs
from ...patches.h3_fp16_overflow import FIX, h3_model_class, hook_dit
from ..devices import real_accelerator


def self_test():
    model_class = h3_model_class()
    if not model_class:
        return ()
    import comfy.ops

    device = real_accelerator() or torch.device("cpu")

    def outputs(dtype, fixed: bool, overflow: bool = True):
        model = tiny_h3_model(model_class, comfy.ops.disable_weight_init, dtype, overflow).to(device)
        handles = hook_dit(model, FIX) if fixed else []
        try:
            return tiny_h3_outputs(model, dtype, device)
        finally:
            remove_handles(handles)

    reference = outputs(torch.float32, fixed=False)
    stock = outputs(torch.float16, fixed=False)
    fixed = outputs(torch.float16, fixed=True)
    bf16_error = (outputs(torch.bfloat16, fixed=False) - reference).abs().max().item()
    fixed_error = (fixed - reference).abs().max().item()
    unchanged = [dtype for dtype in (torch.bfloat16, torch.float32)
                 if torch.equal(outputs(dtype, fixed=True), outputs(dtype, fixed=False))]
    return [
        Check(f"red: fix off, fp16 on {device.type}: the output is not finite (black video, NaN audio)",
              not bool(torch.isfinite(stock).all()),
              f"{int((~torch.isfinite(stock)).sum())} of {stock.numel()} values not finite"),
        Check("green: fix on, fp16: finite and as close to the fp32 run as the bf16 path",
              bool(torch.isfinite(fixed).all()) and fixed_error <= bf16_error,
              f"max abs diff from fp32: fix {fixed_error:.3g}, bf16 path {bf16_error:.3g}"),
        Check("green: fix on, bf16 and fp32: outputs bit for bit stock", len(unchanged) == 2,
              f"bit for bit in {[str(dtype) for dtype in unchanged]}"),
        rescale_check(device),
    ]


def rescale_check(device) -> Check:
    """``f(x / K) * K == f(x)`` bit for bit for an fp16 linear ``f`` whose inputs stay normal after the division."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.rand(64, 128, generator=generator) + 1.0) * torch.randint(-4, 5, (64, 128), generator=generator)
    weight = torch.randn(96, 128, generator=generator)
    x, weight = x.to(device, torch.float16), weight.to(device, torch.float16)
    direct = torch.nn.functional.linear(x, weight)
    rescaled = torch.nn.functional.linear(x / BRANCH_RESCALE, weight) * BRANCH_RESCALE
    return Check(f"green: the branch rescale (K = {BRANCH_RESCALE:g}) is exact in fp16 on {device.type}",
                 torch.equal(direct, rescaled))
