"""Self-test of qwen3vl_rotary_table: a tiny ComfyUI Qwen3-VL vision tower as a lowvram load leaves it (``inv_freq``
and ``pos_embed`` in CPU RAM, the rest on the compute device): without the fix the rotary table is built on the CPU
and copied over (red); with it, on the compute device, outputs equal, no copy after the first call (green)."""

from __future__ import annotations

import torch

from ...contract import Check, remove_handles
from ...contract.comfy import qwen3vl_tower_class
from ...patches.qwen3vl_pos_embed import hook_towers as hook_position_table_fix
from ...patches.qwen3vl_rotary_table import hook_towers
from ..devices import HostToDeviceCopies, real_accelerator
from ..tiny_qwen3vl import TINY_QWEN3VL_GRID, tiny_qwen3vl_tower
from .qwen3vl_pos_embed import all_on_cpu_check, outputs, outputs_match, tiny_pixels

LATER_CALLS = 3


def partially_loaded(tower, device: torch.device) -> torch.Tensor:
    """``tower`` as a lowvram load leaves it: weights on ``device`` except ``pos_embed``'s (offloaded, the usual
    case for the biggest table), and ``inv_freq``, owned by a module without weights, in CPU RAM. Returns that
    buffer."""
    left_behind = tower.rotary_pos_emb.inv_freq
    offloaded = torch.nn.Parameter(tower.pos_embed.weight.detach().clone(), requires_grad=False)
    tower.to(device)
    tower.rotary_pos_emb.inv_freq = left_behind
    tower.pos_embed.weight = offloaded
    return left_behind


def copies_from_host(tower, call):
    """``call()``'s result and how many host-to-device copies it made of anything but ``tower``'s weights (those are
    ComfyUI's own per-layer casts of offloaded weights)."""
    with HostToDeviceCopies() as copies:
        result = call()
    return result, len(copies) - copies.made_from(tower.parameters())


def tables_built_on(tower) -> list[str]:
    """A list that records the device type of every rotary table ``tower`` builds from now on."""
    seen: list[str] = []
    tower.rotary_pos_emb.register_forward_hook(lambda mod, args, output: seen.append(output.device.type))
    return seen


def self_test():
    if qwen3vl_tower_class() is None:
        return ()
    device = real_accelerator() or torch.device("meta")
    grid = torch.tensor(TINY_QWEN3VL_GRID)
    pixels = tiny_pixels()
    tower = tiny_qwen3vl_tower()
    all_on_cpu = all_on_cpu_check(tower, pixels, grid, hook_towers)

    left_behind = partially_loaded(tower, device)
    built_on = tables_built_on(tower)
    on_device = pixels.to(device)
    position_fix = hook_position_table_fix(tower)
    try:
        stock, stock_copies = copies_from_host(tower, lambda: outputs(tower(on_device, grid)))
        checks = [Check(f"red: fix off, inv_freq in CPU RAM, compute on {device.type}: the rotary table is "
                        "built on the CPU and copied over", built_on == ["cpu"] and stock_copies > 0,
                        f"built on {built_on}, {stock_copies} host-to-device copies")]
        built_on.clear()
        with_fix = hook_towers(tower)
        try:
            fixed = outputs(tower(on_device, grid))
            _, later_copies = copies_from_host(tower, lambda: [tower(on_device, grid) for _ in range(LATER_CALLS)])
        finally:
            remove_handles(with_fix)
    finally:
        remove_handles(position_fix)
    same, compared = outputs_match(fixed, stock, device)
    checks.append(Check(f"green: fix on: the table is built on {device.type}, output {compared} equal to the "
                        "stock tower's, no host-to-device copy after the first call, the buffer left as it was",
                        set(built_on) == {device.type} and same and later_copies == 0
                        and tower.rotary_pos_emb.inv_freq is left_behind,
                        f"built on {built_on}, {later_copies} copies in {LATER_CALLS} later calls"))
    return [*checks, all_on_cpu]
