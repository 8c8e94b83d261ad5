"""vae_qk_norm_scale: MiniMax H3 video VAE decode no longer crashes on a ``qk_norm_scale`` left on the CPU.

Bug: the decoder's ``Attention`` owns a non-persistent buffer ``qk_norm_scale`` (a unit RMSNorm scale) and hands it
as is to comfy-kitchen's fused ``rms_rope_split_half(_)``. ComfyUI's legacy loader moves only modules that own
weights, so on any load that is not full (a partially offloaded VAE, ``--novram``/``--disable-dynamic-vram``, XPU,
ROCm < 7.14) the buffer stays on the CPU while q/k are on the GPU; kitchen routes the call to its eager backend, which
fails:
RuntimeError: Expected all tensors to be on the same device, but got weight is on cpu, different from other tensors on cuda:0 (when checking argument in method wrapper_CUDA___fused_rms_norm)

Upstream: Comfy-Org/ComfyUI #16390 (regression in 0.36.0, also 0.37.0), #16484 (closed), PR #16391 (open: moves the
buffer with ``.to(query.device)`` at the call site, a host-to-device copy on every attention call).

Applies to: ComfyUI cores whose ``comfy/ldm/minimax/vae.py`` has ``Attention.qk_norm_scale`` (0.36.0 on). 0.33.0's
Attention has no such buffer (rms_norm, then ``apply_rope_split_half``): not applicable there.

Detection (code structure): a tiny ``Attention`` is built on ``meta`` (a renamed one is the class that registers
``qk_norm_scale``; one whose constructor changed is read from its source); without the buffer the fix is not
applicable. Otherwise ``Attention.forward``'s source is parsed: if ``self.qk_norm_scale`` (or a plain alias of it) is
still passed into a call other than a device move (``.to``/``cast_to*``) the bug is present; if not, fixed upstream.

Off switch: ``MINIMAX_HOTFIX_DISABLE=vae_qk_norm_scale``.

How: attached by the pack's VAE loader and Apply node as an injection. After each load it puts one forward pre/post
hook pair on the VAE's decoder (``ViT3DDecoder``). For the duration of a decoder call every buffer in it that is not on
the input's device (each Attention's ``qk_norm_scale``, the rotary ``inv_freq``) is swapped for a resident copy on that
device (kernels/resident_copies.py: made on the first call, reused while the buffer is the same unmodified tensor) and
put back afterwards, so outside the call the modules hold exactly what ComfyUI left there: dynamic VRAM's buffer
backups and restores and the legacy loader's partial loads see only their own tensors. No host-to-device copy per call
after the first; a buffer already on the compute device is used as it is. Ejecting the model drops the copies.
Overlapping decoder calls (threads, clones sharing the module; kernels/lent_buffers.py): calls on one device share
the swapped-in copies and the last one puts the originals back; a call on another device waits until then (the module
holds one tensor per buffer, so it cannot serve two devices at once).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

import torch

from ..contract import Fix, Retirement, State, Status, Target
from ..kernels.lent_buffers import LentBuffers
from ..kernels.resident_copies import FreeCopiesOnRemove, ResidentCopies

FIX_ID = "vae_qk_norm_scale"
BUFFER = "qk_norm_scale"
DEVICE_MOVES = frozenset({"to", "cast_to", "cast_to_input", "cast_to_device"})


def hands_raw_buffer(function, attribute: str) -> bool:
    """Whether ``function`` passes ``self.<attribute>``, or a local bound only to it, into a call that is not a
    device move."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))

    def is_attribute(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == attribute
                and isinstance(node.value, ast.Name) and node.value.id == "self")

    bindings: dict[str, list[bool]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    bindings.setdefault(target.id, []).append(is_attribute(node.value))
    aliases = {name for name, raw in bindings.items() if all(raw)}

    def is_raw(node) -> bool:
        return is_attribute(node) or (isinstance(node, ast.Name) and node.id in aliases)

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if callee not in DEVICE_MOVES and any(is_raw(arg) for arg in [*node.args, *(k.value for k in node.keywords)]):
            return True
    return False


def owns_scale_buffer(attention) -> bool:
    """Whether the VAE's ``Attention`` class has the ``qk_norm_scale`` buffer: a tiny one is built on meta, or, where
    its constructor takes other arguments now, its source registers the buffer."""
    try:
        with torch.device("meta"):
            return BUFFER in dict(attention(heads=1, dim_head=32).named_buffers())
    except TypeError:
        return _REGISTERS_SCALE.search(inspect.getsource(attention.__init__)) is not None


_REGISTERS_SCALE = re.compile(rf"register_buffer\(\s*[\"']{BUFFER}[\"']")


def attention_class(vae):
    """The VAE's attention class: ``Attention``, or on a core that renamed it the one class of the module that
    registers the ``qk_norm_scale`` buffer."""
    if hasattr(vae, "Attention"):
        return vae.Attention
    found = [value for value in vars(vae).values() if inspect.isclass(value) and value.__module__ == vae.__name__
             and "__init__" in vars(value) and _REGISTERS_SCALE.search(inspect.getsource(value.__init__))]
    return found[0] if len(found) == 1 else None


def keep_buffers_on_input_device(module: torch.nn.Module, copies: ResidentCopies) -> list:
    """Hooks giving every buffer under ``module`` the device of the module's first tensor input for the duration of
    each call.

    A stray buffer is swapped for its resident copy before the call and put back after it (also when the call
    raises), so between calls the modules hold exactly the tensors the model loader put there. Overlapping calls go
    through ``LentBuffers``: calls on one device share the swap, and a call on another device waits for the put-back.
    One hook pair on the decoder instead of one per buffer owner keeps the cost per decoder call to a few
    microseconds.
    """
    lent = LentBuffers.of(module)

    def swap_in(mod, args, kwargs):
        device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if device is not None:
            lent.enter(device, copies)

    def put_back(mod, args, kwargs, output):
        lent.leave()

    return [module.register_forward_pre_hook(swap_in, with_kwargs=True),
            module.register_forward_hook(put_back, with_kwargs=True, always_call=True)]


def decoders(model: torch.nn.Module, vae) -> list[torch.nn.Module]:
    """The MiniMax video decoders in ``model`` (the model itself when it is one)."""
    return [m for m in model.modules() if isinstance(m, vae.ViT3DDecoder)]


def hook_decoders(modules) -> list:
    """Keep each decoder's buffers resident on the device its input arrives on; returns removable handles."""
    copies = ResidentCopies()
    return [handle for m in modules for handle in keep_buffers_on_input_device(m, copies)] + [FreeCopiesOnRemove(copies)]


class VaeQkNormScale(Fix):
    id = FIX_ID
    targets = (Target.VAE,)
    retirement = Retirement(
        fixed_by="Comfy-Org/ComfyUI PR #16391 (open), or any core whose Attention.forward moves qk_norm_scale to the "
                 "query's device",
        delete_when="every supported core reads 'fixed upstream' or 'not applicable' here (no Attention.forward hands "
                    "qk_norm_scale to the kernel as is)")

    def detect(self) -> Status:
        try:
            import comfy.ldm.minimax.vae as vae
        except ImportError:
            return Status(State.NOT_APPLICABLE, "ComfyUI's MiniMax H3 video VAE (comfy.ldm.minimax.vae) is not "
                                                "importable here")
        attention = attention_class(vae)
        if attention is None or not hasattr(vae, "ViT3DDecoder"):
            return Status(State.FAILED, "comfy.ldm.minimax.vae has no Attention or ViT3DDecoder class: the VAE "
                                          "changed, fix left off")
        try:
            owns_buffer = owns_scale_buffer(attention)
        except Exception as exc:
            return Status(State.FAILED, f"Attention(heads=, dim_head=) cannot be built ({type(exc).__name__}: "
                                          f"{exc}): the VAE changed, fix left off")
        if not owns_buffer:
            return Status(State.NOT_APPLICABLE, "this VAE's Attention has no qk_norm_scale buffer (rms_norm, then "
                                                "apply_rope: ComfyUI before 0.36)")
        try:
            raw = hands_raw_buffer(attention.forward, BUFFER)
        except (OSError, TypeError, SyntaxError) as exc:
            return Status(State.FAILED, f"Attention.forward's source cannot be read ({exc}); fix left off")
        if not raw:
            return Status(State.FIXED_UPSTREAM, "Attention.forward no longer hands qk_norm_scale to the kernel as is")
        return Status(State.NEEDED, "Attention.forward hands its qk_norm_scale buffer to rms_rope as is; a load "
                                     "that is not full leaves it on the CPU")

    def hook_loaded_model(self, model) -> list:
        import comfy.ldm.minimax.vae as vae

        found = decoders(model, vae)
        return hook_decoders(found) if found else []


FIX = VaeQkNormScale()
