"""Self-test of vae_qk_norm_scale: a stand-in module with q/k/table on the device and its buffer left on the CPU,
without the fix's hooks (red) and with them (green: runs, routed like the all-on-device call, equal to it on a real
device, the buffer is back after each call and no host-to-device copy follows the first call)."""

from __future__ import annotations

import torch

from ...contract import Check, remove_handles
from ...kernels.ck_rope_device import unaligned_kitchen
from ...kernels.fake_cuda import fake_cuda_mode, on_fake_cuda
from ...patches.vae_qk_norm_scale import BUFFER, hook_decoders
from ..devices import HostToDeviceCopies, real_accelerator
from ..kitchen import real_kitchen_routing, red_check, rope_inputs

LATER_CALLS = 3


class UnitScaleRmsRope(torch.nn.Module):
    """The self-test's stand-in for the VAE's Attention around the bug: owns no weights, only a non-persistent unit
    RMSNorm scale, which it hands as is to kitchen's fused rms+rope."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer(BUFFER, torch.ones(head_dim, dtype=dtype), persistent=False)

    def forward(self, q, k, table):
        kernel = unaligned_kitchen("rms_rope_split_half")
        return kernel(q, k, table, self.qk_norm_scale, rot_dim=table.shape[-3] * 2)


def self_test():
    device = real_accelerator()
    if device is not None:
        return real_device_checks(device)
    return fake_cuda_checks()


def real_device_checks(device) -> list[Check]:
    q, k, table, _ = rope_inputs(lambda t: t.to(device))
    module = UnitScaleRmsRope(q.shape[-1], q.dtype)
    left_behind = module.qk_norm_scale
    checks = [red_check(lambda: module(q, k, table), f"qk_norm_scale on cpu, q/k on {device}")]
    with torch.no_grad():
        reference = UnitScaleRmsRope(q.shape[-1], q.dtype).to(device)(q, k, table)
        fixed, later_copies = hooked_calls(module, q, k, table)
    checks.append(Check("green: with the fix the decode step equals the all-on-device one",
                        all(torch.equal(a, b) for a, b in zip(fixed, reference, strict=True))))
    checks.append(bookkeeping_check(module, left_behind, later_copies))
    return checks


def fake_cuda_checks() -> list[Check]:
    with fake_cuda_mode() as mode, real_kitchen_routing() as chosen:
        q, k, table, _ = rope_inputs(lambda t: on_fake_cuda(mode, t))
        module = UnitScaleRmsRope(q.shape[-1], q.dtype)
        left_behind = module.qk_norm_scale
        red = red_check(lambda: module(q, k, table), "FakeTensor cuda q/k, qk_norm_scale on cpu")
        red_route = chosen[-1]
        first_hooked_call = len(chosen)
        _, later_copies = hooked_calls(module, q, k, table)
        hooked_routes = chosen[first_hooked_call:]
    return [red, Check("green: with the fix the calls are routed to the fast backend", red_route == "eager"
                       and hooked_routes == ["cuda"] * (1 + LATER_CALLS),
                       f"routes: without {red_route}, with {hooked_routes}"),
            bookkeeping_check(module, left_behind, later_copies)]


def hooked_calls(module, *inputs):
    """``module`` called with the fix's hooks on: the first call's output, and the host-to-device copies made by
    ``LATER_CALLS`` more calls (the resident copies should make them none). The hooks are removed afterwards."""
    handles = hook_decoders([module])
    try:
        first = module(*inputs)
        with HostToDeviceCopies() as later_copies:
            for _ in range(LATER_CALLS):
                module(*inputs)
    finally:
        remove_handles(handles)
    return first, len(later_copies)


def bookkeeping_check(module, left_behind, later_copies: int) -> Check:
    return Check("green: the loader's own buffer is back after each call; no host-to-device copy after the first",
                 module.qk_norm_scale is left_behind and later_copies == 0,
                 f"{later_copies} copies in {LATER_CALLS} later calls")
