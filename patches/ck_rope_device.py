"""ck_rope_device: comfy-kitchen's rope kernels take a stray CPU scale or rotation table instead of crashing.

Bug: comfy-kitchen routes each call by the devices of all its tensors. A call whose RMSNorm scale, or rotation
table, sits on the CPU while q/k are on the GPU fails the fused backends' device check (cuda/hip/triton) and falls to
the eager backend, which passes the operands to ``torch.nn.functional.rms_norm`` / the rotation as they are:
"RuntimeError: Expected all tensors to be on the same device, but got weight is on cpu, different from other tensors
on cuda:0 (when checking argument in method wrapper_CUDA___fused_rms_norm)". Any caller that leaves such an operand
behind hits it; MiniMax H3's VAE decode under a partial load is the reported one (vae_qk_norm_scale fixes that
VAE without a per-call copy; this fix covers every other caller).

Upstream: Comfy-Org/ComfyUI #16484 (closed; asks for device alignment in kitchen's eager fallback), #16390, PR #16391.
comfy-kitchen 0.2.31, 0.2.35 and 0.2.40: ``backends/eager/rope.py::_rms_rope1`` does no device alignment.

Applies to: comfy-kitchen with the public ``rms_rope*`` / ``apply_rope*`` functions (0.2.31 to 0.2.40), any ComfyUI
that calls them as ``comfy.quant_ops.ck.<name>`` (looked up at call time, so the wrapped attribute is what runs).

Detection (behaviour): the eager backend's ``rms_rope1`` is run on a CPU input with its scale on ``meta``. A
device-mismatch error means kitchen does not align (bug present); running, or failing only to copy the meta scale,
means kitchen aligns itself (fixed upstream). A rope function whose signature is not (activation, ..., freqs_cis /
scales) disables the fix as drifted.

Off switch: ``MINIMAX_HOTFIX_DISABLE=ck_rope_device`` (read when ComfyUI loads the pack).

How: a process-wide, idempotent, reversible wrapper of the comfy_kitchen module attributes (kernels/rope_device.py):
a stray scale/table is moved to q's device before routing, so the call reaches the fast backend; when the devices
already agree the wrapper makes the very same call. The first move per function and operand is logged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import types

import torch

from ..kernels.rope_device import device_aligned, operand_positions, rope_function_names
from ._devices import fake_cuda_mode, on_fake_cuda, real_accelerator
from ._fix import Check, Fix, State, Status

FIX_ID = "ck_rope_device"
log = logging.getLogger("minimax_hotfix")


def is_device_mismatch(exc: BaseException) -> bool:
    """The error torch raises when one op mixes devices (CUDA, FakeTensor "cuda", meta and CPU wordings)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("same device" in text or "on the expected device" in text)


def eager_aligns_devices() -> bool:
    """Whether kitchen's eager ``rms_rope1`` copes with a scale on another device than its input."""
    from comfy_kitchen.registry import registry

    eager_rms_rope1 = registry.get_implementation("rms_rope1", backend="eager")
    x = torch.zeros(1, 1, 1, 32)
    table = torch.zeros(1, 1, 1, 16, 2, 2)
    try:
        eager_rms_rope1(x, table, torch.ones(32, device="meta"))
    except (RuntimeError, NotImplementedError) as exc:
        if is_device_mismatch(exc):
            return False
        if "meta" in str(exc):  # it tried to move the scale to the input, which meta cannot give
            return True
        raise
    return True


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
        bound = {**defaults, **dict(zip((a.name for a in arguments), args)), **kwargs}
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


class CkRopeDevice(Fix):
    id = FIX_ID
    title = "comfy-kitchen rope kernels: a stray CPU scale/table is moved to q's device and routed to the fast backend"
    targets = ("process",)
    upstream = "Comfy-Org/ComfyUI#16484, #16390, PR #16391; comfy-kitchen eager _rms_rope1 (0.2.31-0.2.40)"

    def __init__(self):
        self._lock = threading.Lock()
        self._installed: dict[str, object] = {}
        self._logged: set[tuple] = set()

    def detect(self) -> Status:
        try:
            import comfy_kitchen
        except ImportError:
            return Status(State.NOT_APPLICABLE, "comfy-kitchen is not installed")
        names = rope_function_names(comfy_kitchen)
        if not names:
            return Status(State.NOT_APPLICABLE, "comfy-kitchen has no rms_rope*/apply_rope* functions")
        drifted = []
        for name in names:
            try:
                operand_positions(self.original(comfy_kitchen, name))
            except (TypeError, ValueError) as exc:
                drifted.append(f"{name}: {exc}")
        if drifted:
            return Status(State.DISABLED, f"rope signatures changed ({'; '.join(drifted)}); fix left off")
        if eager_aligns_devices():
            return Status(State.FIXED_UPSTREAM, "comfy-kitchen's eager rope moves a stray scale to the input itself")
        return Status(State.APPLIED, "comfy-kitchen's eager rope does no device alignment: one CPU scale/table sends "
                                     "the call to eager, which fails")

    def original(self, comfy_kitchen, name):
        current = getattr(comfy_kitchen, name)
        return current.__wrapped__ if current is self._installed.get(name) else current

    def _log_first_move(self, function: str, operand: str, source, target) -> None:
        key = (function, operand, str(source), str(target))
        if key not in self._logged:
            self._logged.add(key)
            log.info("MiniMax Hotfix: %s: moved %s from %s to %s for comfy_kitchen.%s (its caller left it behind; "
                     "logged once)", FIX_ID, operand, source, target, function)

    def install(self) -> None:
        import comfy_kitchen

        with self._lock:
            for name in rope_function_names(comfy_kitchen):
                current = getattr(comfy_kitchen, name)
                if current is self._installed.get(name):
                    continue
                wrapper = device_aligned(current, on_align=self._log_first_move)
                setattr(comfy_kitchen, name, wrapper)
                self._installed[name] = wrapper

    def uninstall(self) -> None:
        try:
            import comfy_kitchen
        except ImportError:
            return
        with self._lock:
            for name, wrapper in self._installed.items():
                if getattr(comfy_kitchen, name, None) is wrapper:
                    setattr(comfy_kitchen, name, wrapper.__wrapped__)
                else:
                    log.warning("MiniMax Hotfix: %s: comfy_kitchen.%s was replaced after this fix wrapped it; left "
                                "as it is", FIX_ID, name)
            self._installed.clear()

    def self_test(self):
        """``rms_rope_split_half`` with q/k/table on the device and the scale left on the CPU, unwrapped (red) and
        through the alignment (green). On a GPU the outputs are compared with the all-on-device call; without one,
        FakeTensor "cuda" inputs go through kitchen's real routing with the CUDA backend's constraints."""
        import comfy_kitchen

        kernel = self.original(comfy_kitchen, "rms_rope_split_half")
        aligned = device_aligned(kernel)
        device = real_accelerator()
        if device is not None:
            q, k, table, scale = rope_inputs(lambda t: t.to(device))
            yield red_check(lambda: kernel(q, k, table, scale, rot_dim=32), f"scale on cpu, q/k on {device}")
            reference = kernel(q, k, table, scale.to(device), rot_dim=32)
            fixed = aligned(q, k, table, scale, rot_dim=32)
            yield Check("green: aligned call equals the all-on-device call",
                        all(torch.equal(a, b) for a, b in zip(fixed, reference)))
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
    same_objects = len(seen) == 1 and all(a is b for a, b in zip(seen[0], inputs))
    return Check("green: devices agreeing, the same tensors reach the kernel and the output is unchanged",
                 same_objects and all(torch.equal(a, b) for a, b in zip(fixed, reference)))


def red_check(call, setup: str) -> Check:
    try:
        call()
    except Exception as exc:
        return Check(f"red: {setup} fails without the fix", is_device_mismatch(exc), f"{type(exc).__name__}: "
                                                                                     f"{str(exc).splitlines()[0]}")
    return Check(f"red: {setup} fails without the fix", False, "it ran: the bug did not reproduce")


FIX = CkRopeDevice()
