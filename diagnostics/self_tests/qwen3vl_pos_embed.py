"""Self-test of qwen3vl_pos_embed: a tiny ComfyUI Qwen3-VL vision tower with ``pos_embed`` left in CPU RAM and the
rest on the compute device (the accelerator, or ``meta``): without the fix the position gather runs on the CPU (red),
with it on the compute device with equal outputs (green); all on CPU, bit-identical to the stock tower."""

from __future__ import annotations

import torch

from ...contract import Check, remove_handles
from ...contract.comfy import qwen3vl_tower_class
from ...patches.qwen3vl_pos_embed import hook_towers
from ..devices import real_accelerator
from ..tiny_qwen3vl import TINY_QWEN3VL_GRID, TINY_QWEN3VL_TOWER, tiny_qwen3vl_tower


def tiny_pixels(seed: int = 1) -> torch.Tensor:
    """Random patch rows for ``TINY_QWEN3VL_GRID`` (one row per patch: channels x temporal patch x patch²)."""
    row = TINY_QWEN3VL_TOWER["in_channels"] * TINY_QWEN3VL_TOWER["temporal_patch_size"] * TINY_QWEN3VL_TOWER["patch_size"] ** 2
    return torch.randn(sum(t * h * w for t, h, w in TINY_QWEN3VL_GRID), row, generator=torch.Generator().manual_seed(seed))


def outputs(output) -> list[torch.Tensor]:
    """The tower's merged tokens and DeepStack features, as one list."""
    merged, deepstack = output
    return [merged, *deepstack]


def outputs_match(fixed, stock, device: torch.device) -> tuple[bool, str]:
    """Whether the fixed tower's outputs equal the stock ones on ``device``, and what was compared: values on a real
    device, shapes and devices on meta (which holds no data)."""
    same = all(a.device == b.device and a.shape == b.shape for a, b in zip(fixed, stock, strict=True))
    if device.type == "meta":
        return same, "shapes and devices"
    return same and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(fixed, stock, strict=True)), "values"


def all_on_cpu_check(tower, pixels, grid, hook_towers) -> Check:
    """With a fix's ``hook_towers`` on ``tower`` while it is all on cpu, the output is bit-identical to the stock
    tower's. Run first, before the tower is split across devices; listed after the red control and its green."""
    resident = [tensor.clone() for tensor in outputs(tower(pixels, grid))]
    with_fix = hook_towers(tower)
    try:
        return Check("green: all on cpu, output bit-identical to the stock tower",
                     all(map(torch.equal, outputs(tower(pixels, grid)), resident)))
    finally:
        remove_handles(with_fix)


def self_test():
    if qwen3vl_tower_class() is None:
        return ()
    device = real_accelerator() or torch.device("meta")
    checks = []
    tower = tiny_qwen3vl_tower()
    grid = torch.tensor(TINY_QWEN3VL_GRID)
    pixels = tiny_pixels()
    all_on_cpu = all_on_cpu_check(tower, pixels, grid, hook_towers)

    gather_devices: list[torch.device] = []
    spy = tower.pos_embed.register_forward_pre_hook(lambda mod, args: gather_devices.append(args[0].device))
    weight = torch.nn.Parameter(tower.pos_embed.weight.detach().clone(), requires_grad=False)
    tower.to(device)
    tower.pos_embed.weight = weight  # offloaded: the weight stays in CPU RAM
    try:
        stock = outputs(tower(pixels.to(device), grid))
        checks.append(Check(f"red: fix off, pos_embed in CPU RAM, compute on {device.type}: the position "
                            "gather runs on the CPU", gather_devices == [torch.device("cpu")],
                            f"gather ran on {[d.type for d in gather_devices]}"))
        gather_devices.clear()
        with_fix = hook_towers(tower)
        try:
            fixed = outputs(tower(pixels.to(device), grid))
        finally:
            remove_handles(with_fix)
        same, compared = outputs_match(fixed, stock, device)
        checks.append(Check(f"green: fix on: the gather runs on {device.type}, output {compared} equal to "
                            "the stock tower's",
                            gather_devices == [device] and same,
                            f"gather ran on {[d.type for d in gather_devices]}"))
    finally:
        spy.remove()
    return [*checks, all_on_cpu]
