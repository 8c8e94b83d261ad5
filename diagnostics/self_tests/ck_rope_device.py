"""Self-test of ck_rope_device: ``rms_rope_split_half`` with q/k/table on the device and the scale left on the CPU,
unwrapped (red) and through the alignment (green). On a GPU the outputs are compared with the all-on-device call;
without one, FakeTensor "cuda" inputs go through kitchen's real routing with the CUDA backend's constraints."""

from __future__ import annotations

import functools

import torch

from ...contract import Check
from ...kernels.ck_rope_device import device_aligned, unaligned_kitchen
from ...kernels.fake_cuda import fake_cuda_mode, on_fake_cuda
from ..devices import real_accelerator
from ..kitchen import real_kitchen_routing, red_check, rope_inputs


def self_test():
    kernel = unaligned_kitchen("rms_rope_split_half")
    aligned = device_aligned(kernel)
    device = real_accelerator()
    if device is not None:
        q, k, table, scale = rope_inputs(lambda t: t.to(device))
        yield red_check(lambda: kernel(q, k, table, scale, rot_dim=32), f"scale on cpu, q/k on {device}")
        reference = kernel(q, k, table, scale.to(device), rot_dim=32)
        fixed = aligned(q, k, table, scale, rot_dim=32)
        yield Check("green: aligned call equals the all-on-device call",
                    all(torch.equal(a, b) for a, b in zip(fixed, reference, strict=True)))
    else:
        yield from fake_cuda_checks(kernel, aligned)
    yield passthrough_check(kernel)


def fake_cuda_checks(kernel, aligned) -> list[Check]:
    with fake_cuda_mode() as mode, real_kitchen_routing() as chosen:
        q, k, table, scale = rope_inputs(lambda t: on_fake_cuda(mode, t))
        red = red_check(lambda: kernel(q, k, table, scale, rot_dim=32), "FakeTensor cuda q/k, cpu scale")
        red_route = chosen[-1]
        kernel(q, k, table, scale.to(q.device), rot_dim=32)
        reference_route = chosen[-1]
        aligned(q, k, table, scale, rot_dim=32)
    return [red, Check("green: the aligned call is routed like the all-on-device call",
                       chosen[-1] == reference_route == "cuda" and red_route == "eager",
                       f"routes: stray scale {red_route}, aligned {chosen[-1]}, all on device {reference_route}")]


def passthrough_check(kernel) -> Check:
    """With every operand on q's device the wrapper makes the very same call, and the output is the kernel's."""
    seen = []

    @functools.wraps(kernel)
    def spy(*args, **kwargs):
        seen.append(args)
        return kernel(*args, **kwargs)

    inputs = rope_inputs(lambda t: t, dtype=torch.float32)
    fixed = device_aligned(spy)(*inputs, rot_dim=32)
    reference = kernel(*inputs, rot_dim=32)
    same_objects = len(seen) == 1 and all(a is b for a, b in zip(seen[0], inputs, strict=True))
    return Check("green: devices agreeing, the same tensors reach the kernel and the output is unchanged",
                 same_objects and all(torch.equal(a, b) for a, b in zip(fixed, reference, strict=True)))
