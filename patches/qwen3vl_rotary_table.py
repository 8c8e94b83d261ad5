"""Fix ``qwen3vl_rotary_table``: ComfyUI's Qwen3-VL / Qwen3.5 vision tower builds its rotary table on the CPU on
every call when a partial load leaves the ``inv_freq`` buffer there.

Bug: ``comfy/text_encoders/qwen35.py`` ``Qwen35VisionModel.rot_pos_emb`` (used by the MiniMax H3 text encoder's
``Qwen3VLVisionModel``) gets its table from ``Qwen35VisionRotaryEmbedding.forward``, which builds it on
``self.inv_freq.device``, and then builds the position ids and the gather on that table's device; ``forward`` moves
the result with ``.to(x.device)``. ``inv_freq`` is a non-persistent buffer of a module that owns no weights, and
ComfyUI's legacy loader moves only modules that own weights unless the load is full: with lowvram / novram /
``--disable-dynamic-vram`` (XPU, ROCm < 7.14, NVIDIA with dynamic VRAM off) the buffer stays in CPU RAM, so every
image builds its N x head_dim/2 float32 table on the CPU and sends it over the bus. No crash, no error text: the
only symptom is host work and a transfer per call (benchmarks/qwen3vl_rotary_table.py measures both).
Dynamic VRAM moves every buffer to the compute device: not affected there.
Upstream: no ComfyUI issue or PR (unchanged in Comfy-Org/ComfyUI at 06990860, the 0.38 era); same class as
#15251 (register_tokens/scale1/scale2, fixed by #15268) and #16390 (qk_norm_scale).
Applies to: ComfyUI with ``comfy/text_encoders/qwen35.py`` (0.33.0 and 06990860 checked).
Already fixed upstream when ``Qwen35VisionRotaryEmbedding.forward`` no longer takes its device from ``inv_freq``;
disabled when the rotary module, ``rot_pos_emb`` or their calls are gone (found by what they do where a core renamed
them: the one rotary class whose forward reads ``inv_freq``, a method ``forward`` calls that reads ``rotary_pos_emb``),
or when the pack's table no longer equals the stock one on a tiny CPU tower (checked once, in ``detect``).
Off switch: ``MINIMAX_HOTFIX_DISABLE=qwen3vl_rotary_table``.

How: an injection on the CLIP patcher records each tower call's compute device (the ContextVar frames of
``kernels/qwen3vl_pos_embed.py``, so two jobs on one tower never see each other's device) and gives the tower's
rotary module an instance ``forward`` that builds the table from a copy of ``inv_freq`` kept on that device
(``kernels/resident_copies.py``: made on the first call, reused while the buffer is unchanged). ``rot_pos_emb`` then
builds position ids and gather on the compute device too, and ``forward``'s ``.to(x.device)`` moves nothing. The
buffer itself is never replaced: between calls the module holds what ComfyUI's loader put there.
"""

from __future__ import annotations

import inspect
import re

import torch

from ..contract import AttributeOverride, Fix, Retirement, State, Status, Target
from ..contract.comfy import qwen3vl_rotary_class, qwen3vl_tower_class
from ..kernels.qwen3vl_pos_embed import compute_device, hook_comfy_towers, rotary_frequency_table, tiny_qwen3vl_tower
from ..kernels.resident_copies import FreeCopiesOnRemove, ResidentCopies

# the buffer's device, read as is, through a local copy of the buffer, or as a default for a device argument
_READS_BUFFER_DEVICE = re.compile(r"device\s*=\s*(?:\w+\s+or\s+)?(?:self\.)?inv_freq\.device")



def _table_on_compute_device(tower, rotary, copies: ResidentCopies):
    """``rotary.forward``, building the table on the device the tower's current call computes on."""
    stock = rotary.forward

    def forward(seqlen, *newer, **newer_keywords):
        device = compute_device(tower)
        inv_freq = rotary.inv_freq
        if device is None or inv_freq.device == device or newer or newer_keywords:
            # arguments a newer core added (a device, say): its own forward knows what they mean, the table does not
            return stock(seqlen, *newer, **newer_keywords)
        return rotary_frequency_table(copies.on(rotary, inv_freq, device), seqlen)

    return forward


def hook_towers(model: torch.nn.Module) -> list:
    """Attach the fix to every ComfyUI Qwen3.5/Qwen3-VL vision tower in ``model``; returns removable handles."""
    tower_class = qwen3vl_tower_class()
    if tower_class is None:
        return []
    copies = ResidentCopies()
    handles = hook_comfy_towers(model, tower_class, lambda tower: AttributeOverride(
        tower.rotary_pos_emb, "forward", _table_on_compute_device(tower, tower.rotary_pos_emb, copies)))
    return handles + [FreeCopiesOnRemove(copies)] if handles else []


class Qwen3VLRotaryTableFix(Fix):
    id = "qwen3vl_rotary_table"
    targets = (Target.CLIP,)
    retirement = Retirement(
        fixed_by="none yet: a core whose Qwen35VisionRotaryEmbedding.forward builds the table on the activations' "
                 "device",
        delete_when="every supported core reads 'fixed upstream' here (the rotary table no longer takes its device "
                    "from inv_freq)")

    def detect(self) -> Status:
        tower_class, rotary_class = qwen3vl_tower_class(), qwen3vl_rotary_class()
        if tower_class is None or rotary_class is None:
            return Status(State.NOT_APPLICABLE, "no ComfyUI Qwen3.5/Qwen3-VL vision tower "
                                                "(comfy.text_encoders.qwen35.Qwen35VisionModel) in this process")
        forward_names = inspect.unwrap(tower_class.forward).__code__.co_names
        builders = [method for name, method in vars(tower_class).items() if name in forward_names and
                    inspect.isfunction(method) and "rotary_pos_emb" in method.__code__.co_names]
        if not builders:  # rot_pos_emb, or a method of another name that forward calls and that reads the table
            return Status(State.FAILED, "Qwen35VisionModel no longer builds its rotary table in rot_pos_emb from "
                                        "self.rotary_pos_emb: target drifted, fix left off")
        if not _READS_BUFFER_DEVICE.search(inspect.getsource(rotary_class.forward)):
            return Status(State.FIXED_UPSTREAM, "Qwen35VisionRotaryEmbedding.forward no longer takes its device "
                                                "from the inv_freq buffer")
        import comfy.ops
        import comfy.text_encoders.qwen3vl

        tower = tiny_qwen3vl_tower(comfy.text_encoders.qwen3vl.Qwen3VLVisionModel, comfy.ops.manual_cast)
        rotary = tower.rotary_pos_emb
        if not torch.equal(rotary_frequency_table(rotary.inv_freq, 14), rotary(14)):
            return Status(State.FAILED, "Qwen35VisionRotaryEmbedding.forward computes something else than the "
                                        "pack's compute-device copy (table changed upstream): fix left off")
        return Status(State.NEEDED, "rot_pos_emb builds the rotary table on the inv_freq buffer's device: a load "
                                     "that is not full leaves it in CPU RAM, so every image builds the table on "
                                     "the CPU and sends it over the bus (no crash: forward moves the result)")

    def hook_loaded_model(self, model) -> list:
        return hook_towers(model)


FIX = Qwen3VLRotaryTableFix()
