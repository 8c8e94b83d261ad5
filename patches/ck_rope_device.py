"""ck_rope_device: comfy-kitchen's rope kernels take a stray CPU scale or rotation table instead of crashing.

Bug: comfy-kitchen routes each call by the devices of all its tensors. A call whose RMSNorm scale, or rotation
table, sits on the CPU while q/k are on the GPU fails the fused backends' device check (cuda/hip/triton) and falls to
the eager backend, which passes the operands to ``torch.nn.functional.rms_norm`` / the rotation as they are. Any caller that leaves such an operand
behind hits it; MiniMax H3's VAE decode under a partial load is the reported one (vae_qk_norm_scale fixes that
VAE without a per-call copy; this fix covers every other caller). The error:
RuntimeError: Expected all tensors to be on the same device, but got weight is on cpu, different from other tensors on cuda:0 (when checking argument in method wrapper_CUDA___fused_rms_norm)

Upstream: Comfy-Org/ComfyUI #16484 (closed; asks for device alignment in kitchen's eager fallback), #16390, PR #16391.
comfy-kitchen 0.2.31, 0.2.35 and 0.2.40: ``backends/eager/rope.py::_rms_rope1`` does no device alignment.

Applies to: comfy-kitchen with the public ``rms_rope*`` / ``apply_rope*`` functions (0.2.31 to 0.2.40), any ComfyUI
that calls them as ``comfy.quant_ops.ck.<name>`` (looked up at call time, so the wrapped attribute is what runs).

Detection (behaviour): the eager backend's ``rms_rope1`` is run on a CPU input with its scale on ``meta``. A
device-mismatch error means kitchen does not align (bug present); running, or failing only to copy the meta scale,
means kitchen aligns itself (fixed upstream). A rope function whose signature is not (activation, ..., freqs_cis /
scales) disables the fix as drifted.

Off switch: ``MINIMAX_HOTFIX_DISABLE=ck_rope_device`` (read when ComfyUI loads the pack).

How: a process-wide, idempotent, reversible wrapper of the comfy_kitchen module attributes (kernels/ck_rope_device.py):
a stray scale/table is moved to q's device before routing, so the call reaches the fast backend; when the devices
already agree the wrapper makes the very same call. The first move per function and operand is logged
(once per installation: uninstalling forgets what was logged).
"""

from __future__ import annotations

import threading

import torch

from ..contract import Fix, Retirement, State, Status, Target, log
from ..kernels.ck_rope_device import (
    device_aligned,
    is_device_mismatch,
    operand_positions,
    rope_function_names,
    unaligned_kitchen,
)

FIX_ID = "ck_rope_device"


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


class CkRopeDevice(Fix):
    id = FIX_ID
    targets = (Target.PROCESS,)
    retirement = Retirement(
        fixed_by="none yet: a comfy-kitchen release whose eager rope moves a stray scale/table to the input's device "
                 "(asked for in Comfy-Org/ComfyUI#16484)",
        delete_when="every comfy-kitchen the supported cores pin aligns devices in its eager rope (this fix then reads "
                    "'fixed upstream' on all of them)")

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
                operand_positions(unaligned_kitchen(name))
            except (TypeError, ValueError) as exc:
                drifted.append(f"{name}: {exc}")
        if drifted:
            return Status(State.FAILED, f"rope signatures changed ({'; '.join(drifted)}); fix left off")
        if eager_aligns_devices():
            return Status(State.FIXED_UPSTREAM, "comfy-kitchen's eager rope moves a stray scale to the input itself")
        return Status(State.NEEDED, "comfy-kitchen's eager rope does no device alignment: one CPU scale/table sends "
                                     "the call to eager, which fails")

    def _log_first_move(self, function: str, operand: str, source, target) -> None:
        key = (function, operand, str(source), str(target))
        with self._lock:  # two threads making the same first move must not both log it
            first = key not in self._logged
            self._logged.add(key)
        if first:
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
            self._logged.clear()  # a later install starts afresh: its first moves are logged again


FIX = CkRopeDevice()
