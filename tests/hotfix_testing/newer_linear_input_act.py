"""The newer ``comfy.ops.linear_input_act`` form for a 0.33.0 core with a newer MiniMax ``vae.py`` overlaid.

That ``vae.py`` calls ``linear_input_act`` with an ``rms_norm``/``swiglu`` input and a fused residual, which 0.33.0's
``comfy.ops`` lacks. Used by the VAE tests, the placement audit's test and benchmarks/vae_qk_norm_scale.py (which
imports it only where the ComfyUI it is pointed at is such a simulated core, built from a checkout's tests/).
"""

from __future__ import annotations

import inspect

import torch.nn.functional as F


def newer_linear_input_act(linear, x, input_act, act_weight=None, act_eps=0.0, residual=None, residual_scale=None):
    """Eager stand-in for the newer form (rms_norm/swiglu input, fused residual)."""
    import comfy.ops

    if input_act == "rms_norm":
        x = F.rms_norm(x, (x.shape[-1],), weight=comfy.ops.cast_to_input(act_weight, x), eps=act_eps)
    elif input_act == "swiglu":
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    out = linear(x)
    return out if residual is None else residual.addcmul(out, residual_scale)


def use_newer_linear_input_act(patch=setattr) -> None:
    """Puts the stand-in into ``comfy.ops`` where the running ComfyUI lacks the newer form, through ``patch``
    (``monkeypatch.setattr`` in a test, so it is undone afterwards)."""
    import comfy.ops

    if "residual" not in inspect.signature(comfy.ops.linear_input_act).parameters:
        patch(comfy.ops, "linear_input_act", newer_linear_input_act)
