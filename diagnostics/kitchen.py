"""comfy-kitchen plumbing shared by the self-tests of ck_rope_device and vae_qk_norm_scale, their tests and
benchmark: kitchen's backend routing replayed for FakeTensor "cuda" and meta inputs (CI machines have no CUDA), rope
inputs shaped for the fused CUDA kernel, and the red control.
"""

from __future__ import annotations

import contextlib
import types

import torch

from ..contract import Check
from ..kernels.ck_rope_device import is_device_mismatch, rope_function_names


@contextlib.contextmanager
def real_kitchen_routing():
    """comfy-kitchen's routing for FakeTensor "cuda" and meta inputs, as a CUDA machine would route them.

    Kitchen's custom ops run their fake kernels for FakeTensor and meta inputs, and those never ask the backend
    registry, so a stray CPU operand goes unnoticed. Inside this context each rope op asks a registry that holds
    kitchen's eager backend and, as "cuda", the real CUDA backend's constraints with a stand-in kernel that returns
    empty outputs (there is no CUDA here). Yields the backend names chosen, in call order.
    """
    import comfy_kitchen
    from comfy_kitchen.backends import cuda as cuda_backend
    from comfy_kitchen.backends import eager as eager_backend
    from comfy_kitchen.registry import BackendRegistry, registry

    names = rope_function_names(comfy_kitchen)
    ops = torch.ops.comfy_kitchen
    packets = {name: getattr(ops, name) for name in names}
    cuda_constraints = cuda_backend._build_constraints()  # what kitchen registers on a CUDA machine
    routing = BackendRegistry()
    routing.set_priority(["cuda", "eager"])
    routing.register("eager", eager_backend, {name: registry.get_constraints("eager", name) for name in names})
    routing.register("cuda", types.SimpleNamespace(**{name: _empty_outputs(packets[name]) for name in names}),
                     {name: cuda_constraints[name] for name in names})
    chosen: list[str] = []
    try:
        for name, packet in packets.items():
            setattr(ops, name, _routed_through(routing, name, packet, chosen))
        yield chosen
    finally:
        for name, packet in packets.items():
            setattr(ops, name, packet)


def _routed_through(routing, name, packet, chosen):
    """What kitchen's custom-op body does: name the arguments, ask the registry, call the chosen kernel."""
    arguments = packet.default._schema.arguments
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}

    def call(*args, **kwargs):
        bound = {**defaults, **dict(zip((a.name for a in arguments), args, strict=False)), **kwargs}
        backend = routing.get_capable_backend(name, bound)
        chosen.append(backend)
        return routing.get_implementation(name, backend=backend)(**bound)

    return call


def _empty_outputs(packet):
    returned = len(packet.default._schema.returns)

    def kernel(**kwargs):
        tensors = [value for value in kwargs.values() if isinstance(value, torch.Tensor)]
        outputs = tuple(torch.empty_like(t) for t in tensors[:returned])
        return outputs[0] if returned == 1 else (outputs or None)

    return kernel


def rope_inputs(place, dtype=torch.bfloat16, seq=8, heads=2, head_dim=64, rot_dim=32):
    """q, k (BNHD) and a split-half rotation table for ``rot_dim``, each passed through ``place`` (to the compute
    device), and a unit RMSNorm scale left on the CPU; shaped for the fused CUDA kernel."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(1, seq, heads, head_dim, generator=generator).to(dtype)
    angles = torch.rand(1, seq, 1, rot_dim // 2, generator=generator)
    c, s = angles.cos(), angles.sin()
    table = torch.stack([c, -s, s, c], dim=-1).reshape(1, seq, 1, rot_dim // 2, 2, 2).to(dtype)
    return place(q), place(k), place(table), torch.ones(head_dim, dtype=dtype)


def red_check(call, setup: str) -> Check:
    """Passes when ``call`` fails with a device mismatch: the bug reproduces with the fix off."""
    name = f"red: {setup} fails without the fix"
    try:
        call()
    except Exception as exc:
        return Check(name, is_device_mismatch(exc), f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    return Check(name, False, "it ran: the bug did not reproduce")
