"""Mutated cores: the simulated cores (hotfix_testing/simulated_cores.py) with one source transformation of the kind upstream
commits make, per mutant, to the code a fix targets. They test the pack's promise on cores nobody here has run: each
fix fixes, says *fixed upstream*, or says *failed* and stays off, and the pack is never worse than stock.

A mutant edits files of its base core's tree (exact text replaced, found exactly once, so a mutant whose text has
drifted fails loudly instead of testing nothing), adds files (a class moved to a new module) or removes them. Its
scenario (hotfix_testing/mutant_runs.py) runs a tiny model on the simulated accelerator three times: on the CPU, loaded partly
without the pack, and with the pack's fixes attached.

Outcome of a mutant (``outcome``):
* "repaired": stock fails or computes something else than the CPU; the pack's output equals the CPU's.
* "fixed upstream": stock completes equal to the CPU's and the pack computes exactly what stock does, with no more
  host-to-device bytes.
* "failed, same as stock": the fix reads *failed* and the pack fails exactly as stock does.
* "missed, same as stock": the mutant keeps the bug and the pack does exactly what stock does, where the fix reads
  *fixed upstream* or *not applicable*, or reads *needed* but its hooks do not reach the changed code (a detection
  that did not recognise the bug: safe, and nothing for the user).
* "worse than stock": anything else (an error of the pack's own, another output, more traffic, a traceback).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
REPAIRED, FIXED_UPSTREAM, FAILED_AS_STOCK, MISSED, WORSE = (
    "repaired", "fixed upstream", "failed, same as stock", "missed, same as stock", "worse than stock")
OUTCOMES = (REPAIRED, FIXED_UPSTREAM, FAILED_AS_STOCK, MISSED, WORSE)
# the kinds of change upstream commits make (issue: mutated cores), one column group of the outcome table each
RENAME, SIGNATURE, DEVICE, REFACTOR = ("renamed, moved or removed", "parameters changed", "device handling changed",
                                       "structural refactor")
KINDS = (RENAME, SIGNATURE, DEVICE, REFACTOR)
DIFF_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Edit:
    """In ``path`` (relative to the core's tree): ``old`` (found exactly once) becomes ``new``."""

    path: str
    old: str
    new: str
    every: bool = False  # every occurrence (a rename), at least one


@dataclass(frozen=True)
class FunctionEdit:
    """In the source of ``module``'s function ``function`` ("Class.method" for a method; an installed library's, e.g.
    comfy-kitchen or transformers, which is not part of the core's tree): ``old`` becomes ``new``; the result is
    executed with the module's globals and takes the function's place (or, renamed, sits beside it)."""

    module: str
    function: str
    old: str
    new: str
    every: bool = False
    renames: bool = False  # the edited function is there under its new name only (the original removed)


@dataclass(frozen=True)
class Mutant:
    name: str
    fix: str
    kind: str
    core: str  # the simulated core it mutates ("" for a transformers-only mutant, run on ``transformers``)
    scenario: str  # hotfix_testing/mutant_runs.py SCENARIOS
    why: str  # the upstream change it stands for
    edits: tuple[Edit, ...] = ()
    function_edits: tuple[FunctionEdit, ...] = ()
    copies: tuple[tuple[str, str], ...] = ()  # (new path, path): new modules copied from the core's, executed first
    module: str = ""  # where the scenario finds its model class, when the mutant moved it
    target_class: str = ""  # the model class's name, when the mutant renamed it
    keeps_bug: bool = True  # the stock run still shows the bug (fails, or its traffic where the bug costs)
    # the stock run fails on the simulated accelerator although it would not on CUDA: the accelerator checks a custom
    # op's devices at its entry, CUDA only in the aten ops its implementation runs
    stock_fails_on_the_simulated_device_only: bool = False
    reloads: tuple[str, ...] = ()  # importers executed again, in this order, after the modules they import from
    # the transformers tier (tests/requirements-transformers-<version>.txt) a core-less mutant runs on
    transformers: str = ""


def replaced(text: str, old: str, new: str, every: bool, where: str) -> str:
    count = text.count(old)
    if count != 1 and not (every and count):
        raise ValueError(f"{where} holds its text {count} times, not once (the core drifted under the mutant): "
                         f"{old[:80]!r}")
    return text.replace(old, new)  # once, or every occurrence


MISSING = object()


@contextlib.contextmanager
def functions_edited(mutant: Mutant, folder: Path):
    """The mutant's function edits in place of the functions (their edited sources written under ``folder``), put
    back afterwards."""
    saved = []
    try:
        for number, edit in enumerate(mutant.function_edits):
            module = importlib.import_module(edit.module)
            *path, name = edit.function.split(".")  # a module's function, or "Class.method"
            owner = functools.reduce(getattr, path, module)
            source = textwrap.dedent(inspect.getsource(inspect.unwrap(getattr(owner, name))))
            file = folder / f"{edit.module}.{edit.function}.{number}.py"
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(replaced(source, edit.old, edit.new, edit.every,
                                     f"mutant {mutant.name!r}: {edit.module}.{edit.function}"), encoding="utf-8")
            defined = {}  # run with the module's globals: the function (with its decorators) as the module makes it
            exec(compile(file.read_text(encoding="utf-8"), str(file), "exec"), vars(module), defined)  # noqa: S102
            if edit.renames:
                saved.append((owner, name, vars(owner)[name]))
                delattr(owner, name)
            for new_name, value in defined.items():
                saved.append((owner, new_name, vars(owner).get(new_name, MISSING)))
                setattr(owner, new_name, value)
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is MISSING:  # the mutant added it
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def mutated_sources(tree: Path, mutant: Mutant) -> dict[str, str]:
    """path -> the mutant's source of each module it changes, in the order they are executed."""
    sources: dict[str, str] = {new: (tree / path).read_text(encoding="utf-8") for new, path in mutant.copies}
    for edit in mutant.edits:
        source = sources.get(edit.path) or (tree / edit.path).read_text(encoding="utf-8")
        sources[edit.path] = replaced(source, edit.old, edit.new, edit.every, f"mutant {mutant.name!r}: {edit.path}")
    for path in mutant.reloads:  # after the modules they import from, in their own order, edited or not
        sources[path] = sources.pop(path, None) or (tree / path).read_text(encoding="utf-8")
    return sources


VAE = "comfy/ldm/minimax/vae.py"
VAE_CORE = "0.36/0.37 VAE"
VAE_CALL = "                query, key, rotary_pos_emb, self.qk_norm_scale,\n"
ATTENTION_CLASS = "class Attention(nn.Module):\n"


def vae_mutant(name, kind, why, *edits, **options) -> Mutant:
    return Mutant(name, "vae_qk_norm_scale", kind, VAE_CORE, "vae_decode", why, tuple(Edit(VAE, *e) for e in edits),
                  **options)


QWEN = "comfy/text_encoders/qwen35.py"
QWEN_CORE = "0.38 Qwen3-VL"
QWEN_VL = "comfy/text_encoders/qwen3vl.py"  # its tower subclasses qwen35's: executed again after each edit
POS_FORWARD = "        pos_embeds = self.fast_pos_embed_interpolate(grid_thw).to(x.device)\n"
ROT_FORWARD = "        rotary_pos_emb = self.rot_pos_emb(grid_thw).to(x.device)\n"
POS_DEVICE = "        device = self.pos_embed.weight.device\n"
ROT_DEVICE = "        seq = torch.arange(seqlen, device=self.inv_freq.device, dtype=self.inv_freq.dtype)\n"


def tower_mutant(fix, name, kind, why, *edits, **options) -> Mutant:
    return Mutant(name, fix, kind, QWEN_CORE, "vision_tower", why,
                  tuple(Edit(*e) if len(e) == 3 else Edit(QWEN, *e) for e in edits), reloads=(QWEN_VL,), **options)


def pos_mutant(name, kind, why, *edits, **options) -> Mutant:
    return tower_mutant("qwen3vl_pos_embed", f"pos-embed: {name}", kind, why, *edits, **options)


def rot_mutant(name, kind, why, *edits, **options) -> Mutant:
    return tower_mutant("qwen3vl_rotary_table", f"rotary: {name}", kind, why, *edits, **options)


TOWER_RENAMED = ((QWEN, "class Qwen35VisionModel(nn.Module):", "class Qwen35VisionTower(nn.Module):"),
                 (QWEN_VL, "from .qwen35 import Qwen35VisionModel", "from .qwen35 import Qwen35VisionTower"),
                 (QWEN_VL, "class Qwen3VLVisionModel(Qwen35VisionModel):", "class Qwen3VLVisionModel(Qwen35VisionTower):"))

MUTANTS = (
    vae_mutant("vae: as the core ships it", DEVICE, "0.36/0.37: qk_norm_scale handed to rms_rope as is (#16390)",
               (VAE_CALL, VAE_CALL)),
    vae_mutant("vae: Attention renamed", RENAME, "a rename of the attention class (H3 LightVAE / Sol-H3 style)",
               (ATTENTION_CLASS, "class VideoAttention(nn.Module):\n"),
               ("self.attn = Attention(", "self.attn = VideoAttention(")),
    vae_mutant("vae: ViT3DDecoder renamed", RENAME, "the decoder class renamed",
               ("class ViT3DDecoder(", "class ViTDecoder3D("), target_class="ViTDecoder3D"),
    vae_mutant("vae: Attention moved to its own module", RENAME, "the attention class moved to another module "
               "(here a copy of vae.py), imported back", (ATTENTION_CLASS, "from comfy.ldm.minimax.vae_attention import Attention\n\n\n"
                                 "class _MovedAttention(nn.Module):\n"),
               copies=(("comfy/ldm/minimax/vae_attention.py", VAE),)),
    vae_mutant("vae: call-site .to(query.device)", DEVICE, "PR #16391's fix",
               (VAE_CALL, VAE_CALL.replace("self.qk_norm_scale,", "self.qk_norm_scale.to(query.device),")),
               keeps_bug=False),
    vae_mutant("vae: cast_to at the call site", DEVICE, "the upstream fix in comfy.model_management.cast_to's shape",
               (VAE_CALL, VAE_CALL.replace("self.qk_norm_scale,", "comfy.model_management.cast_to("
                                                                  "self.qk_norm_scale, device=query.device),")),
               keeps_bug=False),
    vae_mutant("vae: scale built on the compute device", DEVICE, "the unit scale made per call on the query's device",
               (VAE_CALL, VAE_CALL.replace("self.qk_norm_scale,", "torch.ones(self.dim_head, device=query.device, "
                                                                  "dtype=query.dtype),")), keeps_bug=False),
    vae_mutant("vae: persistent buffer", DEVICE, "qk_norm_scale made a persistent buffer (in the state dict)",
               ('self.register_buffer("qk_norm_scale", torch.ones(dim_head), persistent=False)',
                'self.register_buffer("qk_norm_scale", torch.ones(dim_head), persistent=True)')),
    vae_mutant("vae: scale passed by keyword", SIGNATURE, "the kernel's scale passed as q_scale=",
               (VAE_CALL, "                query, key, rotary_pos_emb, q_scale=self.qk_norm_scale,\n")),
    vae_mutant("vae: Attention takes a new required argument", SIGNATURE, "Attention(dim, heads, dim_head): a new "
               "leading parameter", ("    def __init__(self, heads, dim_head, bias=True, eps=1e-5, operations=ops):\n"
                                     "        super().__init__()\n        self.dim_head = dim_head\n",
                                     "    def __init__(self, dim, heads, dim_head, bias=True, eps=1e-5, "
                                     "operations=ops):\n        super().__init__()\n        self.dim_head = dim_head\n"),
               ("self.attn = Attention(heads=heads", "self.attn = Attention(dim, heads=heads")),
    vae_mutant("vae: forward gains transformer_options", SIGNATURE, "Attention.forward(..., transformer_options={})",
               ("    def forward(self, x, rotary_pos_emb, pre_norm, residual, residual_scale):",
                "    def forward(self, x, rotary_pos_emb, pre_norm, residual, residual_scale, transformer_options={}):")),
    vae_mutant("vae: norm and rope unfused", REFACTOR, "the fused rms+rope kernel split into rms_norm then "
               "apply_rope, the scale still handed as is",
               ("            query, key = rms_rope(\n" + VAE_CALL,
                "            query = comfy.rmsnorm.rms_norm(query, self.qk_norm_scale, self.norm_q.eps)\n"
                "            key = comfy.rmsnorm.rms_norm(key, self.qk_norm_scale, self.norm_k.eps)\n"
                "            query, key = comfy.quant_ops.ck.apply_rope_split_half(query, key, rotary_pos_emb) "
                "if False else rms_rope(\n" + VAE_CALL)),
    pos_mutant("as the core ships it", DEVICE, "0.38: the table built on pos_embed.weight's device", (POS_DEVICE,
               POS_DEVICE)),
    pos_mutant("method renamed", RENAME, "fast_pos_embed_interpolate renamed",
               ("def fast_pos_embed_interpolate(self, grid_thw):", "def interpolate_pos_embed(self, grid_thw):"),
               (POS_FORWARD, POS_FORWARD.replace("fast_pos_embed_interpolate", "interpolate_pos_embed"))),
    pos_mutant("tower renamed", RENAME, "Qwen35VisionModel renamed", *TOWER_RENAMED),
    pos_mutant("device parameter", SIGNATURE, "the method takes the compute device, forward passes x.device",
               ("def fast_pos_embed_interpolate(self, grid_thw):", "def fast_pos_embed_interpolate(self, grid_thw, "
                                                                   "device=None):"),
               (POS_DEVICE, "        device = self.pos_embed.weight.device if device is None else device\n"),
               (POS_FORWARD, POS_FORWARD.replace("(grid_thw)", "(grid_thw, device=x.device)")), keeps_bug=False),
    pos_mutant("forward gains an argument", SIGNATURE, "forward(self, x, grid_thw, transformer_options={})",
               ("    def forward(self, x, grid_thw):\n        x = self.patch_embed(x)\n",
                "    def forward(self, x, grid_thw, transformer_options={}):\n        x = self.patch_embed(x)\n")),
    pos_mutant("table on the compute device", DEVICE, "the upstream fix: built where the patches are",
               (POS_DEVICE, "        device = comfy.model_management.get_torch_device()\n"),
               ("import torch\n", "import torch\nimport comfy.model_management\n"), keeps_bug=False),
    pos_mutant("result no longer moved", DEVICE, "forward adds the table as built (transformers' shape: a crash)",
               (POS_FORWARD, POS_FORWARD.replace(".to(x.device)", ""))),
    pos_mutant("embedding renamed", REFACTOR, "pos_embed renamed position_embedding",
               ("self.pos_embed = ops.Embedding(", "self.position_embedding = ops.Embedding("),
               (POS_DEVICE, POS_DEVICE.replace("pos_embed", "position_embedding")),
               ("dtype=self.pos_embed.weight.dtype", "dtype=self.position_embedding.weight.dtype"),
               ("pos_embeds = self.pos_embed(idx_tensor)", "pos_embeds = self.position_embedding(idx_tensor)")),
    rot_mutant("as the core ships it", DEVICE, "0.38: the rotary table built on inv_freq's device",
               (ROT_DEVICE, ROT_DEVICE)),
    rot_mutant("method renamed", RENAME, "rot_pos_emb renamed",
               ("def rot_pos_emb(self, grid_thw):", "def rotary_embedding(self, grid_thw):"),
               (ROT_FORWARD, ROT_FORWARD.replace("rot_pos_emb", "rotary_embedding"))),
    rot_mutant("rotary class renamed", RENAME, "Qwen35VisionRotaryEmbedding renamed",
               ("class Qwen35VisionRotaryEmbedding(", "class VisionRotaryEmbedding("),
               ("= Qwen35VisionRotaryEmbedding(", "= VisionRotaryEmbedding(")),
    rot_mutant("tower renamed", RENAME, "Qwen35VisionModel renamed", *TOWER_RENAMED),
    rot_mutant("device parameter", SIGNATURE, "the rotary forward takes the device",
               ("    def forward(self, seqlen):\n", "    def forward(self, seqlen, device=None):\n"),
               (ROT_DEVICE, ROT_DEVICE.replace("device=self.inv_freq.device", "device=device or self.inv_freq.device"))),
    rot_mutant("persistent buffer", DEVICE, "inv_freq made a persistent buffer",
               ('self.register_buffer("inv_freq", inv_freq, persistent=False)',
                'self.register_buffer("inv_freq", inv_freq, persistent=True)')),
    rot_mutant("result no longer moved", DEVICE, "forward uses the table as built",
               (ROT_FORWARD, ROT_FORWARD.replace(".to(x.device)", ""))),
    rot_mutant("table on the compute device", DEVICE, "the upstream fix: arange and inv_freq on the compute device",
               (ROT_DEVICE, "        device = comfy.model_management.get_torch_device()\n"
                            "        seq = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)\n"),
               ("        freqs = torch.outer(seq, self.inv_freq)\n",
                "        freqs = torch.outer(seq, self.inv_freq.to(device))\n"),
               ("import torch\n", "import torch\nimport comfy.model_management\n"), keeps_bug=False),
    rot_mutant("frequencies computed per call", REFACTOR, "no buffer: the frequencies made in forward",
               (ROT_DEVICE, "        inv_freq = self.inv_freq.new_tensor(self.inv_freq.tolist())\n"
                            "        seq = torch.arange(seqlen, device=inv_freq.device, dtype=inv_freq.dtype)\n"),
               ("        freqs = torch.outer(seq, self.inv_freq)\n", "        freqs = torch.outer(seq, inv_freq)\n")),
)

OPS = "comfy/ops.py"
INT8_CORE = "0.33.0"
LIA_DEF = "def linear_input_act(linear, x, input_act):\n"
LIA_GUARD = "    if (comfy.model_management.in_training\n"


def int8_mutant(name, why, kind, *edits, **options) -> Mutant:
    return Mutant(f"int8: {name}", "int8_full_precision_mm", kind, INT8_CORE, "int8_vae", why,
                  tuple(Edit(OPS, *edit) for edit in edits), **options)


MUTANTS += (
    int8_mutant("as the core ships it", "0.33.0: linear_input_act hands every int8 layer to _int_mm", DEVICE,
                (LIA_DEF, LIA_DEF)),
    int8_mutant("new keyword with a default", "linear_input_act(..., out_dtype=None): a parameter this fix does "
                "not know", SIGNATURE, (LIA_DEF, "def linear_input_act(linear, x, input_act, out_dtype=None):\n")),
    int8_mutant("new required parameter", "linear_input_act(linear, x, input_act, stream): a parameter without a "
                "default", SIGNATURE, (LIA_DEF, "def linear_input_act(linear, x, input_act, stream):\n")),
    int8_mutant("parameters reordered", "linear_input_act(x, linear, input_act)", SIGNATURE,
                (LIA_DEF, "def linear_input_act(x, linear, input_act):\n")),
    int8_mutant("renamed", "linear_input_act renamed fused_linear_act", RENAME,
                (LIA_DEF, "def fused_linear_act(linear, x, input_act):\n"), target_class="fused_linear_act"),
    int8_mutant("removed", "linear_input_act removed: callers compute linear(act(x)) themselves", RENAME,
                (LIA_DEF, "def _removed_linear_input_act(linear, x, input_act):\n"), target_class="-"),
    int8_mutant("honours _full_precision_mm", "#16285's shape: layers marked _full_precision_mm dequantize (the "
                "VAE's are not marked)", DEVICE,
                (LIA_GUARD, "    if (comfy.model_management.in_training or getattr(linear, '_full_precision_mm', "
                            "False)\n")),
    int8_mutant("dequantizes off int8 devices", "the upstream fix by device: no int8 kernel where the device lacks "
                "int8 compute", DEVICE,
                (LIA_GUARD, "    if (comfy.model_management.in_training or x.device.type not in ('cuda', 'cpu')\n")),
    int8_mutant("activations table renamed", "INPUT_ACT_EAGER renamed EAGER_INPUT_ACTS", REFACTOR,
                ("INPUT_ACT_EAGER", "EAGER_INPUT_ACTS", True)),
    int8_mutant("cast_bias_weight renamed", "cast_bias_weight renamed cast_weight_and_bias", REFACTOR,
                ("cast_bias_weight(", "cast_weight_and_bias(", True)),
)

KITCHEN = "comfy_kitchen"
EAGER_ROPE = "comfy_kitchen.backends.eager.rope"
SPLIT_HALF_ = "rms_rope_split_half_"  # what the 0.36/0.37 VAE calls in inference mode
SPLIT_HALF_SIGNATURE = ("    q: torch.Tensor, k: torch.Tensor, freqs_cis: torch.Tensor,\n"
                        "    q_scale: torch.Tensor, k_scale: torch.Tensor | None = None,\n"
                        "    epsilon: float = 1e-6, rot_dim: int = 0,\n")


def kitchen_mutant(name, kind, why, *function_edits, vae_edits=(), **options) -> Mutant:
    return Mutant(f"kitchen: {name}", "ck_rope_device", kind, VAE_CORE, "vae_decode_process_fixes", why,
                  tuple(Edit(VAE, *edit) for edit in vae_edits), function_edits=tuple(
                      FunctionEdit(*edit) for edit in function_edits), **options)


MUTANTS += (
    kitchen_mutant("as it ships", DEVICE, "comfy-kitchen 0.2.36: the eager rope does no device alignment",
                   (KITCHEN, SPLIT_HALF_, SPLIT_HALF_SIGNATURE, SPLIT_HALF_SIGNATURE)),
    kitchen_mutant("new tensor argument", SIGNATURE, "rms_rope_split_half_(..., k_bias: Tensor | None = None)",
                   (KITCHEN, SPLIT_HALF_, SPLIT_HALF_SIGNATURE, SPLIT_HALF_SIGNATURE
                    + "    k_bias: torch.Tensor | None = None,\n")),
    kitchen_mutant("new flag", SIGNATURE, "rms_rope_split_half_(..., interleaved: bool = False)",
                   (KITCHEN, SPLIT_HALF_, SPLIT_HALF_SIGNATURE, SPLIT_HALF_SIGNATURE
                    + "    interleaved: bool = False,\n")),
    kitchen_mutant("scale parameters renamed", SIGNATURE, "q_scale/k_scale renamed q_weight/k_weight",
                   (KITCHEN, SPLIT_HALF_, "    q_scale: torch.Tensor, k_scale: torch.Tensor | None = None,\n",
                    "    q_weight: torch.Tensor, k_weight: torch.Tensor | None = None,\n"),
                   (KITCHEN, SPLIT_HALF_, "q, k, freqs_cis, q_scale, k_scale, epsilon", "q, k, freqs_cis, q_weight, "
                                                                                       "k_weight, epsilon")),
    kitchen_mutant("activations renamed", SIGNATURE, "q/k renamed query/key",
                   (KITCHEN, SPLIT_HALF_, "    q: torch.Tensor, k: torch.Tensor, freqs_cis", "    query: torch.Tensor, "
                                                                                            "key: torch.Tensor, freqs_cis"),
                   (KITCHEN, SPLIT_HALF_, "        q, k, freqs_cis, q_scale", "        query, key, freqs_cis, q_scale"),
                   (KITCHEN, SPLIT_HALF_, "    return q, k", "    return query, key")),
    kitchen_mutant("new public name", RENAME, "a new entry point rms_rope_split_half_inplace, which the VAE calls",
                   (KITCHEN, SPLIT_HALF_, "def rms_rope_split_half_(", "def rms_rope_split_half_inplace("),
                   vae_edits=(("else comfy.quant_ops.ck.rms_rope_split_half_)",
                               "else comfy.quant_ops.ck.rms_rope_split_half_inplace)"),)),
    kitchen_mutant("eager moves the scale", DEVICE, "the upstream fix asked for in #16484: eager aligns the scale",
                   (EAGER_ROPE, "_rms_rope1", "        weight=scale,\n", "        weight=scale.to(x.device),\n"),
                   keeps_bug=False, stock_fails_on_the_simulated_device_only=True),
    kitchen_mutant("eager casts the scale", DEVICE, "the same fix in another shape: scale cast to x (device and "
                   "dtype)", (EAGER_ROPE, "_rms_rope1", "        weight=scale,\n", "        weight=scale.to(x),\n"),
                   keeps_bug=False, stock_fails_on_the_simulated_device_only=True),
    kitchen_mutant("eager builds a unit scale", REFACTOR, "the eager norm ignores a scale of ones and makes none",
                   (EAGER_ROPE, "_rms_rope1", "        weight=scale,\n",
                    "        weight=None if bool((scale == 1).all()) else scale,\n"), keeps_bug=False,
                   stock_fails_on_the_simulated_device_only=True),
    kitchen_mutant("public function moves the scale", DEVICE, "the fix at kitchen's entry point: the scales moved to "
                   "q's device before the op", (KITCHEN, SPLIT_HALF_, "    torch.ops.comfy_kitchen.rms_rope_split_half_(",
                                                "    q_scale = q_scale.to(q.device)\n"
                                                "    torch.ops.comfy_kitchen.rms_rope_split_half_("), keeps_bug=False),
)


MUSIC3_CORE = "post-#15861 Music 3"
LLAMA = "comfy/text_encoders/llama.py"
AR = "comfy/ldm/minimax_music/ar.py"
MUSIC = "comfy/text_encoders/minimax_music.py"
PREFETCH = "comfy/model_prefetch.py"
MUSIC3_IMPORTERS = (AR, MUSIC)  # each imports from the one before it: executed again after an edit
FEEDBACK_CALL = "            output = self.model(None, embeds=feedback, past_key_values=past, dtype=execution_dtype)\n"
LOOP_START = "        generator = torch.Generator(device=device).manual_seed(derive_seed(seed, \"ar\"))\n"
FORWARD_BUFFERS = ("            if decode_buffers is None:\n"
                   "                x = x.clone()\n"
                   "            else:\n"
                   "                hidden_buffer, rotary_buffer = decode_buffers\n"
                   "                hidden_buffer.copy_(x)\n"
                   "                x = hidden_buffer\n"
                   "                rotary_buffer.copy_(rope_matrix(freqs_cis))\n"
                   "                freqs_cis = rotary_buffer\n")
FORWARD_SIGNATURE = "input_ids=None,deepstack_embeds=None, visual_pos_masks=None, decode_buffers=None):"
UNITS_METHOD = "    def get_dynamic_vram__units(self):\n"
V_BLOCK_GATE = "getattr(module, \"_v_block\", None) is not None"


def music3_mutant(fix, name, kind, why, *edits, gguf=False, **options) -> Mutant:
    return Mutant(f"{fix.removeprefix('music3_graph_')}: {name}", fix, kind, MUSIC3_CORE,
                  "music3_graphs_gguf" if gguf else "music3_graphs", why, tuple(Edit(*edit) for edit in edits),
                  reloads=MUSIC3_IMPORTERS, **options)


def buffers_mutant(name, kind, why, *edits, **options) -> Mutant:
    return music3_mutant("music3_graph_buffers", name, kind, why, *edits, **options)


def capture_mutant(name, kind, why, *edits, **options) -> Mutant:
    return music3_mutant("music3_graph_capture", name, kind, why, *edits, gguf=True, **options)


AR_PASSES_BUFFERS = ((AR, LOOP_START, LOOP_START + "        decode_buffers = self.model.init_decode_buffers(2, device, "
                                                   "execution_dtype)\n"),
                     (AR, FEEDBACK_CALL, FEEDBACK_CALL.replace("dtype=execution_dtype)", "dtype=execution_dtype, "
                                                                                        "decode_buffers=decode_buffers)")))
GRAPHS_OFF_IN_FORWARD = (LLAMA, "        enable_graph = self.graph_dynamic_vbar_blocks and (",
                         "        enable_graph = False and (")
GRAPHS_OFF_IN_DEPTH = (AR, "core=depth_core, enable_graph=True,", "core=depth_core, enable_graph=False,")

MUTANTS += (
    buffers_mutant("as the core ships it", DEVICE, "after #15861: the AR loop passes no decode_buffers (#16222)",
                   (AR, FEEDBACK_CALL, FEEDBACK_CALL)),
    buffers_mutant("AR loop passes decode buffers", DEVICE, "#16428's fix", *AR_PASSES_BUFFERS, keeps_bug=False),
    buffers_mutant("buffers made on every step", DEVICE, "the loop passes decode_buffers, new ones each step (new "
                   "addresses: replays still stale)",
                   (AR, FEEDBACK_CALL, FEEDBACK_CALL.replace("dtype=execution_dtype)", "dtype=execution_dtype, "
                    "decode_buffers=self.model.init_decode_buffers(2, device, execution_dtype))"))),
    buffers_mutant("forward without decode_buffers", SIGNATURE, "Llama2_.forward without decode_buffers, cloning",
                   (LLAMA, FORWARD_SIGNATURE, FORWARD_SIGNATURE.replace(", decode_buffers=None):", "):")),
                   (LLAMA, FORWARD_BUFFERS, "                x = x.clone()\n")),
    buffers_mutant("decode_buffers renamed", SIGNATURE, "decode_buffers renamed static_buffers",
                   (LLAMA, "decode_buffers", "static_buffers", True)),
    buffers_mutant("init_decode_buffers renamed", RENAME, "init_decode_buffers renamed make_decode_buffers",
                   (LLAMA, "def init_decode_buffers(", "def make_decode_buffers(")),
    buffers_mutant("forward gains a keyword", SIGNATURE, "Llama2_.forward(..., transformer_options={})",
                   (LLAMA, FORWARD_SIGNATURE, FORWARD_SIGNATURE.replace("=None):", "=None, transformer_options={}):"))),
    buffers_mutant("graphs off in the decoder", DEVICE, "the #16002 workaround: Llama2_ no longer graphs its decode "
                   "steps", GRAPHS_OFF_IN_FORWARD, keeps_bug=False),
    buffers_mutant("AR loop gains a parameter", SIGNATURE, "MiniMaxMusic3AR.generate(..., stop_on_silence=False)",
                   (AR, "cfg_scale=CFG_SCALE, top_k=CFG_TOP_K):", "cfg_scale=CFG_SCALE, top_k=CFG_TOP_K, "
                                                              "stop_on_silence=False):")),
    capture_mutant("as the core ships it", DEVICE, "every Music 3 graph unit captured, a GGUF Q4_0 one too (#16002)",
                   (PREFETCH, V_BLOCK_GATE, V_BLOCK_GATE)),
    capture_mutant("units method renamed", RENAME, "get_dynamic_vram__units renamed dynamic_vram_units",
                   (MUSIC, UNITS_METHOD, "    def dynamic_vram_units(self):\n"), target_class="dynamic_vram_units"),
    capture_mutant("capture gate moved", REFACTOR, "prefetch_queue_pop's _v_block gate moved into a helper (the "
                   "emulated prefetch keeps the old gate)",
                   (PREFETCH, "and " + V_BLOCK_GATE, "and _has_vbar(module)"),
                   (PREFETCH, "def prefetch_queue_pop(", "def _has_vbar(module):\n    return " + V_BLOCK_GATE
                    + "\n\n\ndef prefetch_queue_pop(")),
    capture_mutant("prefetch gains a parameter", SIGNATURE, "prefetch_queue_pop(..., stream=None)",
                   (PREFETCH, "generator=None, malloc_scope=None):", "generator=None, malloc_scope=None, stream=None):")),
    capture_mutant("forward gains a keyword", SIGNATURE, "Llama2_.forward(..., transformer_options={})",
                   (LLAMA, FORWARD_SIGNATURE, FORWARD_SIGNATURE.replace("=None):", "=None, transformer_options={}):"))),
    capture_mutant("graphs off in Music 3", DEVICE, "the #16002 workaround: neither Music 3 graph path captures",
                   GRAPHS_OFF_IN_FORWARD, GRAPHS_OFF_IN_DEPTH, keeps_bug=False),
    capture_mutant("decoder units merged", REFACTOR, "the decoder's layers one dynamic-VRAM unit (a list of roots)",
                   (LLAMA, "        return (list(self.layers), []) if self.graph_dynamic_vbar_blocks else ([], [])",
                    "        return ([list(self.layers)], []) if self.graph_dynamic_vbar_blocks else ([], [])")),
    capture_mutant("units method removed", RENAME, "the units API gone from the text encoder: nothing is a graph "
                   "unit, nothing captured", (MUSIC, UNITS_METHOD, "    def _removed_units(self):\n"),
                   target_class="-", keeps_bug=False),
)


MODEL_MANAGEMENT = "comfy.model_management"
NVFP4 = "supports_nvfp4_compute"
NVFP4_START = "    if not is_nvidia():\n"


def query_mutant(name, kind, why, *function_edits, **options) -> Mutant:
    return Mutant(f"queries: {name}", "cpu_device_cuda_query", kind, INT8_CORE, "cuda_queries", why,
                  function_edits=tuple(FunctionEdit(MODEL_MANAGEMENT, *edit) for edit in function_edits), **options)


MUTANTS += (
    query_mutant("as the core ships them", DEVICE, "0.33.0: supports_*_compute ask CUDA about a CPU device (#16365)",
                 (NVFP4, NVFP4_START, NVFP4_START)),
    query_mutant("one query checks the device", DEVICE, "the upstream fix's shape: a non-CUDA device answers False "
                 "first", (NVFP4, NVFP4_START, "    if device is not None and torch.device(device).type != 'cuda':\n"
                                               "        return False\n" + NVFP4_START),
                 target_class=NVFP4, keeps_bug=False),
    query_mutant("one query asks is_device_cpu", DEVICE, "the same fix through ComfyUI's own is_device_cpu",
                 (NVFP4, NVFP4_START, "    if is_device_cpu(device):\n        return False\n" + NVFP4_START),
                 target_class=NVFP4, keeps_bug=False),
    query_mutant("a query gains a keyword", SIGNATURE, "supports_nvfp4_compute(device=None, allow_emulation=False)",
                 (NVFP4, "def supports_nvfp4_compute(device=None):", "def supports_nvfp4_compute(device=None, "
                                                                    "allow_emulation=False):")),
    query_mutant("device parameter renamed", SIGNATURE, "supports_nvfp4_compute(dev=None)",
                 (NVFP4, "def supports_nvfp4_compute(device=None):", "def supports_nvfp4_compute(dev=None):"),
                 (NVFP4, "get_device_properties(device)", "get_device_properties(dev)")),
    query_mutant("a query renamed", RENAME, "supports_nvfp4_compute renamed supports_fp4_compute (its callers too)",
                 (NVFP4, "def supports_nvfp4_compute(", "def supports_fp4_compute("),
                 target_class="supports_fp8_compute,supports_fp4_compute,supports_mxfp8_compute"),
    query_mutant("a new query with the same bug", REFACTOR, "a supports_int4_compute written like the others",
                 (NVFP4, "def supports_nvfp4_compute(", "def supports_int4_compute("),
                 target_class="supports_int4_compute,supports_nvfp4_compute"),
    query_mutant("queries merged", REFACTOR, "one supports_compute(device, format) for every format",
                 (NVFP4, "def supports_nvfp4_compute(device=None):", "def supports_compute(device=None, "
                                                                    "quant_format='nvfp4'):"),
                 target_class="supports_compute"),
)


QWEN3_VL = "transformers.models.qwen3_vl.modeling_qwen3_vl"
TOWER_FORWARD = "Qwen3VLVisionModel.forward"
# a method's source is edited dedented: its body four spaces in
GATHER = "    pos_embeds = (self.pos_embed(interp_indices) * interp_weights[:, :, None]).sum(1)\n"
ADD = "    hidden_states = hidden_states + pos_embeds.to(hidden_states.dtype)\n"


def transformers_mutant(name, kind, why, *edits, **options) -> Mutant:
    return Mutant(f"transformers: {name}", "transformers_qwen3vl_pos_embed", kind, INT8_CORE, "transformers_tower",
                  why, function_edits=tuple(FunctionEdit(QWEN3_VL, TOWER_FORWARD, *edit) for edit in edits),
                  **options)


MUTANTS += (
    transformers_mutant("as it ships", DEVICE, "transformers 5.24's indexing form: no device reconciled", (ADD, ADD)),
    transformers_mutant("the add moves the table", DEVICE, "half an upstream fix: the table follows hidden_states' "
                        "device, grid_thw's rotary positions still do not", (ADD, ADD.replace(".to(hidden_states.dtype)",
                                                                  ".to(hidden_states.device, hidden_states.dtype)"))),
    transformers_mutant("the add casts to the activations", DEVICE, "the same half-fix as .to(hidden_states)",
                        (ADD, ADD.replace(".to(hidden_states.dtype)", ".to(hidden_states)"))),
    transformers_mutant("the gather on the weight's device", DEVICE, "indices moved to pos_embed's weight, the table "
                        "not moved back (the crash moves to the add)",
                        (GATHER, GATHER.replace("self.pos_embed(interp_indices)",
                                                "self.pos_embed(interp_indices.to(self.pos_embed.weight.device))"))),
    transformers_mutant("forward gains a keyword", SIGNATURE, "forward(..., output_attentions=False, **kwargs)",
                        ("grid_thw: torch.Tensor, **kwargs", "grid_thw: torch.Tensor, output_attentions: bool = False, "
                                                            "**kwargs")),
    transformers_mutant("grid renamed", SIGNATURE, "grid_thw renamed image_grid_thw",
                        ("grid_thw", "image_grid_thw", True)),
    transformers_mutant("functional gather", REFACTOR, "the table gathered with F.embedding on pos_embed's weight",
                        (GATHER, GATHER.replace("self.pos_embed(interp_indices)",
                                                "nn.functional.embedding(interp_indices, self.pos_embed.weight)"))),
    transformers_mutant("forward reconciles every device", DEVICE, "the upstream fix in full: grid_thw follows the "
                        "activations, the gather the weight, the table the activations",
                        ("    interp_indices, interp_weights = get_vision", "    grid_thw = grid_thw.to(hidden_states"
                                                                           ".device)\n    interp_indices, interp_weights "
                                                                           "= get_vision"),
                        (GATHER, GATHER.replace("self.pos_embed(interp_indices)",
                                                "self.pos_embed(interp_indices.to(self.pos_embed.weight.device))"
                                                ".to(interp_weights.device)")),
                        (ADD, ADD.replace(".to(hidden_states.dtype)", ".to(hidden_states.device, hidden_states.dtype)")),
                        keeps_bug=False),
)


GENERATION = "transformers.generation.utils"
PREPARE = "GenerationMixin.prepare_inputs_for_generation"
INIT_SHAPE = "GenerationMixin._get_static_cache_init_shape"
PREPARE_STATIC = "GenerationMixin._prepare_static_cache"
STATIC_CACHE_TRANSFORMERS = "5.19"  # both bugs (tests/requirements-transformers-5.19.txt)
# transformers 5.19's prepare_inputs_for_generation, step 6: top-level tensors only reach the model device
MOVE_TOP_LEVEL = ("            if isinstance(value, torch.Tensor):\n"
                  "                model_inputs[key] = value.to(self.device)\n")
MOVE_STEP = ('    input_tensor = model_inputs.get("inputs_embeds", model_inputs[input_ids_key])  # input_ids is None for '
             'embeds\n    if self.device.type != "meta" and input_tensor is not None and input_tensor.device != '
             'self.device:\n        for key, value in model_inputs.items():\n' + MOVE_TOP_LEVEL)
MASK_INPUTS = ("            inputs_embeds=torch.empty((batch_size, sequence_length, 0), dtype=self.dtype, "
               "device=input_ids.device),\n")
TP_DIVIDES = "    if tp_size > 1:\n"


def static_cache_mutant(name, kind, scenario, why, *edits, **options) -> Mutant:
    return Mutant(f"static cache: {name}", "transformers_static_cache", kind, "", scenario, why,
                  function_edits=tuple(FunctionEdit(GENERATION, *edit) for edit in edits),
                  transformers=STATIC_CACHE_TRANSFORMERS, **options)


def masks_mutant(name, kind, why, *edits, **options) -> Mutant:
    return static_cache_mutant(name, kind, "static_cache_masks", why, *((PREPARE, *e) for e in edits), **options)


def tp_mutant(name, kind, why, *edits, **options) -> Mutant:
    return static_cache_mutant(name, kind, "static_cache_tp_heads", why, *edits, **options)


MUTANTS += (
    masks_mutant("as it ships", DEVICE, "transformers 5.19: the per-layer-type mask dict stays on the host",
                 (MOVE_TOP_LEVEL, MOVE_TOP_LEVEL)),
    masks_mutant("prepare gains a keyword", SIGNATURE, "prepare_inputs_for_generation(..., output_router_logits=False)",
                 ("    is_first_iteration: bool | None = False,\n", "    is_first_iteration: bool | None = False,\n"
                                                                 "    output_router_logits: bool = False,\n")),
    masks_mutant("is_first_iteration through kwargs", SIGNATURE, "the parameter dropped from the signature, read "
                 "from **kwargs (the older form)",
                 ("    is_first_iteration: bool | None = False,\n", ""),
                 ("    # Instantiate output\n", "    is_first_iteration = kwargs.pop(\"is_first_iteration\", False)\n")),
    masks_mutant("moved into a helper", RENAME, "step 6 moved into its own method, _move_to_model_device",
                 (MOVE_STEP, "    return self._move_to_model_device(model_inputs, input_ids_key)\n\n\n"
                             "def _move_to_model_device(self, model_inputs, input_ids_key):\n" + MOVE_STEP)),
    masks_mutant("the move names its keys", REFACTOR, "step 6 moves the inputs the forward takes, by name",
                 ("        for key, value in model_inputs.items():\n" + MOVE_TOP_LEVEL,
                  '        for key in ("input_ids", "inputs_embeds", "position_ids", "attention_mask", '
                  '"token_type_ids"):\n            value = model_inputs.get(key)\n' + MOVE_TOP_LEVEL)),
    masks_mutant("nested inputs moved", DEVICE, "the upstream fix (5.20.2): step 6 moves the tensors in dicts too",
                 (MOVE_TOP_LEVEL, MOVE_TOP_LEVEL + "            elif isinstance(value, dict):\n"
                  "                model_inputs[key] = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v "
                  "for k, v in value.items()}\n"), keeps_bug=False),
    masks_mutant("masks built on the model device", DEVICE, "the 2D mask moved first, the per-type masks built on the "
                 "model device", (MASK_INPUTS, MASK_INPUTS.replace("device=input_ids.device", "device=self.device")),
                 ("        causal_mask_creation_function = ", "        if attention_mask is not None:\n"
                  "            attention_mask = attention_mask.to(self.device)\n"
                  "        causal_mask_creation_function = "), keeps_bug=False),
    tp_mutant("init shape renamed", RENAME, "_get_static_cache_init_shape renamed _get_static_cache_shape (its caller "
              "too)", (INIT_SHAPE, "def _get_static_cache_init_shape(", "def _get_static_cache_shape(", False, True),
              (PREPARE_STATIC, "self._get_static_cache_init_shape()", "self._get_static_cache_shape()")),
    tp_mutant("init shape takes the TP size", SIGNATURE, "_get_static_cache_init_shape(tp_size=None), its caller "
              "passing the model's",
              (INIT_SHAPE, "    self: \"GenerativePreTrainedModel\",\n", "    self: \"GenerativePreTrainedModel\",\n"
                                                                       "    tp_size: int | None = None,\n"),
              (INIT_SHAPE, '    tp_size = getattr(self, "_tp_size", None) or 1\n',
               '    tp_size = tp_size or getattr(self, "_tp_size", None) or 1\n'),
              (PREPARE_STATIC, "self._get_static_cache_init_shape()", "self._get_static_cache_init_shape("
                                                                     "tp_size=self._tp_size)")),
    tp_mutant("division in a helper", REFACTOR, "the per-rank division moved into _kv_heads_per_rank (still "
              "unconditional)",
              (INIT_SHAPE, TP_DIVIDES, "    return self._kv_heads_per_rank(num_heads, head_dim, tp_size)\n\n\n"
                                       "def _kv_heads_per_rank(self, num_heads, head_dim, tp_size):\n" + TP_DIVIDES)),
    tp_mutant("divided only for sharded k/v", DEVICE, "the upstream fix (5.20.2): the heads divided only for a "
              "colwise key projection",
              (INIT_SHAPE, TP_DIVIDES, '    if tp_size > 1 and any(key.endswith("k_proj") and style == "colwise" '
                                       'for key, style in (getattr(self, "tp_plan", None) or {}).items()):\n'),
              keeps_bug=False),
)

DIT = "comfy/ldm/minimax/model.py"
DIT_CORE = "0.39 era"  # the newest DiT here: its blocks take a sparse-attention patch's attention
BLOCK_FORWARD = "    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):\n"
REFINER_FORWARD = ("        x = self.attn(self.norm1(x), transformer_options=transformer_options).add_(x)\n"
                   "        return self.mlp(self.norm2(x)).add_(x)\n")
REFINER_CALL = "            text_states = self.token_refiner(self.condition_proj(text_states),\n"
MLP_FORWARD = "        return self.fc2(self.fc1(x), input_act=\"swiglu\")\n"
OUT_PROJ_CALL = "        return self.out_proj(out.squeeze(0))\n"
GATED_ADD = "        x[a:b].addcmul_(other[a:b], _mod_row(gate, row, x.dtype))\n    return x\n"
FINAL_NORM = "        self.norm = operations.RMSNorm(hidden, eps=eps, dtype=dtype, device=device)\n"


def dit_mutant(name, kind, why, *edits, **options) -> Mutant:
    return Mutant(f"h3 dit: {name}", "h3_fp16_overflow", kind, DIT_CORE, "h3_fp16", why,
                  tuple(Edit(DIT, *edit) for edit in edits), **options)


# The residual stream and condition_proj in fp32, the branches in the weights' dtype (half the upstream fix: the
# branch outputs still overflow in fp16).
FP32_STREAM = (
    ("        h = torch.empty(layout.seq_len, self.hidden_size, dtype=dtype, device=device)\n",
     "        h = torch.empty(layout.seq_len, self.hidden_size, dtype=torch.float32, device=device)\n"),
    ("        self.condition_proj = operations.Linear(text_dim, hidden_size, bias=True, dtype=dtype, device=device)",
     "        self.condition_proj = operations.Linear(text_dim, hidden_size, bias=True, dtype=torch.float32, "
     "device=device)"),
    (REFINER_CALL, REFINER_CALL.replace("(text_states)", "(text_states.float())")),
    ("self.condition_proj(text_states[0])", "self.condition_proj(text_states[0].float())"),
    (REFINER_FORWARD, "        compute = self.norm1.weight.dtype\n"
                      "        x = self.attn(self.norm1(x).to(compute), transformer_options=transformer_options)"
                      ".float().add_(x)\n"
                      "        return self.mlp(self.norm2(x).to(compute)).float().add_(x)\n"),
    ("        h = _mod_scale_shift(self.norm1(x), shift_msa, scale_msa, mod_segments)\n",
     "        h = _mod_scale_shift(self.norm1(x), shift_msa, scale_msa, mod_segments).to(rope_freqs.dtype)\n"),
    ("        h = _mod_scale_shift(self.norm2(x), shift_mlp, scale_mlp, mod_segments)\n",
     "        h = _mod_scale_shift(self.norm2(x), shift_mlp, scale_mlp, mod_segments).to(rope_freqs.dtype)\n"),
)
# The other half: out_proj and fc2 stored and computed in fp32.
FP32_BRANCHES = (
    ("        self.out_proj = operations.Linear(inner, hidden, bias=False, dtype=dtype, device=device)",
     "        self.out_proj = operations.Linear(inner, hidden, bias=False, dtype=torch.float32, device=device)"),
    (OUT_PROJ_CALL, OUT_PROJ_CALL.replace("out.squeeze(0)", "out.squeeze(0).float()")),
    ("        self.fc2 = operations.Linear(ffn, hidden, bias=False, dtype=dtype, device=device)",
     "        self.fc2 = operations.Linear(ffn, hidden, bias=False, dtype=torch.float32, device=device)"),
    (MLP_FORWARD, MLP_FORWARD.replace("self.fc1(x)", "self.fc1(x).float()")),
)

MUTANTS += (
    dit_mutant("as the core ships it", DEVICE, "0.39 era: the DiT computes in its compute dtype throughout (#15262, "
               "#15315: black video in fp16)", (BLOCK_FORWARD, BLOCK_FORWARD)),
    dit_mutant("DiTBlock renamed", RENAME, "DiTBlock renamed MiniMaxTransformerBlock",
               ("DiTBlock(", "MiniMaxTransformerBlock(", True)),
    dit_mutant("token refiner renamed", RENAME, "TokenRefiner and RefinerBlock renamed TextRefiner and "
               "TextRefinerBlock", ("RefinerBlock(", "TextRefinerBlock(", True), ("TokenRefiner(", "TextRefiner(", True)),
    dit_mutant("model class renamed", RENAME, "MiniMaxH3Model renamed MiniMaxH3DiT",
               ("class MiniMaxH3Model(", "class MiniMaxH3DiT("), target_class="MiniMaxH3DiT"),
    dit_mutant("modulation helpers renamed", RENAME, "_mod_scale_shift and _mod_gate renamed _modulate and "
               "_gated_residual", ("_mod_scale_shift(", "_modulate(", True), ("_mod_gate(", "_gated_residual(", True)),
    dit_mutant("block forward gains a keyword", SIGNATURE, "DiTBlock.forward(..., block_index=None): a parameter "
               "this fix does not know", (BLOCK_FORWARD, BLOCK_FORWARD.replace("=None):", "=None, block_index=None):"))),
    dit_mutant("refiner takes a text mask", SIGNATURE, "TokenRefiner.forward(..., text_mask=None), its caller "
               "passing the payload's",
               ("    def forward(self, x, transformer_options={}):\n        for block in self.blocks:\n",
                "    def forward(self, x, transformer_options={}, text_mask=None):\n        if text_mask is not None:\n"
                "            x = x * text_mask\n        for block in self.blocks:\n"),
               ("                                             transformer_options=transformer_options)\n",
                "                                             transformer_options=transformer_options,\n"
                "                                             text_mask=payload.get(\"text_mask\"))\n")),
    dit_mutant("fp16 stream clamped", DEVICE, "the workaround other ComfyUI models carry: condition_proj and the "
               "stream clamped to fp16's range after each residual add (the clamped attention-sink row, normalized, "
               "keeps its direction: the tiny H3 lands as close to fp32 as bf16 does)",
               (GATED_ADD, GATED_ADD.replace("    return x\n", "    return _clamp_fp16(x)\n\n\n"
                                             "def _clamp_fp16(x):\n"
                                             "    return x.clamp_(-65504.0, 65504.0) if x.dtype == torch.float16 "
                                             "else x\n")),
               (REFINER_FORWARD, "        x = _clamp_fp16(self.attn(self.norm1(x), transformer_options="
                                 "transformer_options).add_(x))\n"
                                 "        return _clamp_fp16(self.mlp(self.norm2(x)).add_(x))\n"),
               (REFINER_CALL, REFINER_CALL.replace("self.condition_proj(text_states)",
                                                   "_clamp_fp16(self.condition_proj(text_states))")),
               keeps_bug=False),
    dit_mutant("fp32 stream, fp16 branches", DEVICE, "half an upstream fix: the residual stream and condition_proj "
               "in fp32, out_proj and fc2 still in the compute dtype", *FP32_STREAM),
    dit_mutant("fp32 islands", DEVICE, "the upstream fix in the core's own shape: the residual stream, "
               "condition_proj, out_proj and fc2 in fp32 (as the output heads are)", *FP32_STREAM, *FP32_BRANCHES,
               keeps_bug=False),
    dit_mutant("swiglu unfused", REFACTOR, "the MLP's swiglu computed from fc1's halves, fc2 called without "
               "input_act",
               (MLP_FORWARD, "        gate, up = self.fc1(x).chunk(2, dim=-1)\n"
                             "        return self.fc2(nn.functional.silu(gate) * up)\n")),
    dit_mutant("out_proj through the cast context", REFACTOR, "the attention's out_proj applied as a function on "
               "its cast weight (the 0.39 era's PDD heads' form): no module call",
               (OUT_PROJ_CALL, "        with comfy.ops.CastBiasWeightContext(self.out_proj, out, offloadable=True) "
                               "as (weight, bias):\n"
                               "            return nn.functional.linear(out.squeeze(0), weight, bias)\n")),
    dit_mutant("final norm moved to the model", REFACTOR, "FinalLayer takes the normalized stream; the norm is the "
               "model's norm_out",
               (FINAL_NORM, ""),
               ("            return (self.norm(x[a:b]) * ", "            return (x[a:b] * "),
               ("        self.final_layer = FinalLayer(", "        self.norm_out = operations.RMSNorm(hidden_size, "
                "eps=final_norm_eps, dtype=dtype, device=device)\n        self.final_layer = FinalLayer("),
               ("        v, a = self.final_layer(h, ", "        v, a = self.final_layer(self.norm_out(h), ")),
)

# What each mutant gives today: a detection made more general shows here as a row that moved to "repaired" (and a
# regression as one that moved away); "worse than stock" is never expected.
EXPECTED = {
    "vae: as the core ships it": REPAIRED,
    "vae: Attention renamed": REPAIRED,
    "vae: ViT3DDecoder renamed": FAILED_AS_STOCK,
    "vae: Attention moved to its own module": REPAIRED,
    "vae: call-site .to(query.device)": FIXED_UPSTREAM,
    "vae: cast_to at the call site": FIXED_UPSTREAM,
    "vae: scale built on the compute device": FIXED_UPSTREAM,
    "vae: persistent buffer": REPAIRED,
    "vae: scale passed by keyword": REPAIRED,
    "vae: Attention takes a new required argument": REPAIRED,
    "vae: forward gains transformer_options": REPAIRED,
    "vae: norm and rope unfused": REPAIRED,
    "pos-embed: as the core ships it": REPAIRED,
    "pos-embed: method renamed": REPAIRED,
    "pos-embed: tower renamed": REPAIRED,
    "pos-embed: device parameter": FIXED_UPSTREAM,
    "pos-embed: forward gains an argument": REPAIRED,
    "pos-embed: table on the compute device": FIXED_UPSTREAM,
    "pos-embed: result no longer moved": REPAIRED,
    "pos-embed: embedding renamed": MISSED,
    "rotary: as the core ships it": REPAIRED,
    "rotary: method renamed": REPAIRED,
    "rotary: rotary class renamed": REPAIRED,
    "rotary: tower renamed": REPAIRED,
    "rotary: device parameter": REPAIRED,
    "rotary: persistent buffer": REPAIRED,
    "rotary: result no longer moved": REPAIRED,
    "rotary: table on the compute device": FIXED_UPSTREAM,
    "rotary: frequencies computed per call": REPAIRED,
    "int8: as the core ships it": REPAIRED,
    "int8: new keyword with a default": REPAIRED,
    "int8: new required parameter": FAILED_AS_STOCK,
    "int8: parameters reordered": REPAIRED,
    "int8: renamed": MISSED,
    "int8: removed": REPAIRED,
    "int8: honours _full_precision_mm": REPAIRED,
    "int8: dequantizes off int8 devices": REPAIRED,
    "int8: activations table renamed": FAILED_AS_STOCK,
    "int8: cast_bias_weight renamed": FAILED_AS_STOCK,
    "kitchen: as it ships": REPAIRED,
    "kitchen: new tensor argument": REPAIRED,
    "kitchen: new flag": REPAIRED,
    "kitchen: scale parameters renamed": REPAIRED,
    "kitchen: activations renamed": FAILED_AS_STOCK,
    "kitchen: new public name": REPAIRED,
    "kitchen: eager moves the scale": FIXED_UPSTREAM,
    "kitchen: eager casts the scale": FIXED_UPSTREAM,
    "kitchen: eager builds a unit scale": FIXED_UPSTREAM,
    "kitchen: public function moves the scale": FIXED_UPSTREAM,
    "buffers: as the core ships it": REPAIRED,
    "buffers: AR loop passes decode buffers": FIXED_UPSTREAM,
    "buffers: buffers made on every step": MISSED,
    "buffers: forward without decode_buffers": FAILED_AS_STOCK,
    "buffers: decode_buffers renamed": FAILED_AS_STOCK,
    "buffers: init_decode_buffers renamed": FAILED_AS_STOCK,
    "buffers: forward gains a keyword": REPAIRED,
    "buffers: graphs off in the decoder": FIXED_UPSTREAM,
    "buffers: AR loop gains a parameter": REPAIRED,
    "capture: as the core ships it": REPAIRED,
    "capture: units method renamed": REPAIRED,
    "capture: capture gate moved": REPAIRED,
    "capture: prefetch gains a parameter": REPAIRED,
    "capture: forward gains a keyword": REPAIRED,
    "capture: graphs off in Music 3": FIXED_UPSTREAM,
    "capture: decoder units merged": REPAIRED,
    "capture: units method removed": FIXED_UPSTREAM,
    "queries: as the core ships them": REPAIRED,
    "queries: one query checks the device": FIXED_UPSTREAM,
    "queries: one query asks is_device_cpu": FIXED_UPSTREAM,
    "queries: a query gains a keyword": REPAIRED,
    "queries: device parameter renamed": FAILED_AS_STOCK,
    "queries: a query renamed": REPAIRED,
    "queries: a new query with the same bug": REPAIRED,
    "queries: queries merged": REPAIRED,
    "transformers: as it ships": REPAIRED,
    "transformers: the add moves the table": MISSED,
    "transformers: the add casts to the activations": REPAIRED,
    "transformers: the gather on the weight's device": REPAIRED,
    "transformers: forward gains a keyword": REPAIRED,
    "transformers: grid renamed": REPAIRED,
    "transformers: functional gather": FAILED_AS_STOCK,
    "transformers: forward reconciles every device": FIXED_UPSTREAM,
    "static cache: as it ships": REPAIRED,
    "static cache: prepare gains a keyword": REPAIRED,
    "static cache: is_first_iteration through kwargs": REPAIRED,
    "static cache: moved into a helper": REPAIRED,
    "static cache: the move names its keys": REPAIRED,
    "static cache: nested inputs moved": FIXED_UPSTREAM,
    "static cache: masks built on the model device": FIXED_UPSTREAM,
    "static cache: init shape renamed": MISSED,
    "static cache: init shape takes the TP size": REPAIRED,
    "static cache: division in a helper": REPAIRED,
    "static cache: divided only for sharded k/v": FIXED_UPSTREAM,
    "h3 dit: as the core ships it": REPAIRED,
    "h3 dit: DiTBlock renamed": REPAIRED,
    "h3 dit: token refiner renamed": REPAIRED,
    "h3 dit: model class renamed": REPAIRED,
    "h3 dit: modulation helpers renamed": FAILED_AS_STOCK,
    "h3 dit: block forward gains a keyword": FAILED_AS_STOCK,
    "h3 dit: refiner takes a text mask": FAILED_AS_STOCK,
    "h3 dit: fp16 stream clamped": FIXED_UPSTREAM,
    "h3 dit: fp32 stream, fp16 branches": REPAIRED,
    "h3 dit: fp32 islands": FIXED_UPSTREAM,
    "h3 dit: swiglu unfused": REPAIRED,
    "h3 dit: out_proj through the cast context": FAILED_AS_STOCK,
    "h3 dit: final norm moved to the model": FAILED_AS_STOCK,
}


def named(name: str) -> Mutant:
    (mutant,) = [mutant for mutant in MUTANTS if mutant.name == name]
    return mutant


def outcome(record: dict, keeps_bug: bool = False) -> str:
    """The mutant's column of the outcome table (module docstring)."""
    if {"pack_traceback", "core_error", "invalid"} & set(record):
        return WORSE
    state, stock, pack = record["state"], record["stock"], record["pack"]
    if state == "needed" and keeps_bug:
        if matches_reference(pack):
            return REPAIRED
        as_stock = pack.get("error") == stock["error"] if "error" in stock else pack.get("equal_stock") is True
        return MISSED if as_stock else WORSE
    same = (pack.get("error") == stock.get("error") and pack.get("equal_stock") is not False
            and pack["h2d"] <= stock["h2d"])
    if not same:
        return WORSE
    # "needed" on a mutant without the bug: the pack attached, and must change nothing
    return FAILED_AS_STOCK if state == "failed" else MISSED if keeps_bug else FIXED_UPSTREAM


def matches_reference(run: dict) -> bool:
    """The run completed with the reference's output, within its scenario's tolerance (an output holding NaN never
    does)."""
    return "error" not in run and run["diff"] <= run.get("tolerance", DIFF_TOLERANCE)


def same_values(stock, pack) -> bool:
    """``pack`` holds exactly ``stock``'s values; a NaN where stock has one is the same value (an fp16 run that
    overflowed gives the same NaNs twice, and NaN equals nothing)."""
    return (stock.shape == pack.shape and stock.dtype == pack.dtype
            and bool(stock.isclose(pack, rtol=0.0, atol=0.0, equal_nan=True).all()))


def compared(runs: dict, reference, tolerance: float = DIFF_TOLERANCE) -> dict:
    """Stock and pack runs (``output`` or ``error``; ``h2d``, 0 where a run does not measure it) against the
    reference output: each run's largest difference from it, the largest that still counts as the reference's
    output (``tolerance``: a scenario computing in another dtype than its reference sets its own), and whether pack
    computed exactly what stock did."""
    outputs = {label: result.pop("output", None) for label, result in runs.items()}
    outcome = {label: {"h2d": 0, **result, "equal_stock": None, "tolerance": tolerance,
                       "diff": None if outputs[label] is None
                       else (outputs[label].float() - reference.float()).abs().max().item()}
               for label, result in runs.items()}
    if outputs["stock"] is not None and outputs["pack"] is not None:
        outcome["pack"]["equal_stock"] = same_values(outputs["stock"], outputs["pack"])
    return outcome


class Problems(logging.Handler):
    """Log records of level ERROR and up, or carrying a traceback, while the pack loads or installs its fixes."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.found = []

    def emit(self, record):
        if record.levelno >= logging.ERROR or record.exc_info:
            self.found.append(f"{record.name}: {record.getMessage()[:300]}")


def records_of(done: subprocess.CompletedProcess, mutants: list[Mutant], where: str) -> list[dict]:
    """The ``MUTANT`` lines a runner printed, one per mutant, or a RuntimeError with the runner's output."""
    records = [json.loads(line.removeprefix("MUTANT ")) for line in done.stdout.splitlines()
               if line.startswith("MUTANT ")]
    if done.returncode != 0 or len(records) != len(mutants):
        raise RuntimeError(f"mutant runs {where} ended with {done.returncode}:\n{done.stdout[-4000:]}\n"
                           f"{done.stderr[-6000:]}")
    return records


def run_on_transformers(mutants: list[Mutant]) -> list[dict]:
    """Runs core-less ``mutants`` (hotfix_testing/static_cache_mutants.py) in one process of this Python, with this
    process's PYTHONPATH (a transformers tier's overlay first) and the tests' import path."""
    from hotfix_testing import child_pythonpath

    env = {**os.environ, "PYTHONPATH": child_pythonpath(os.environ.get("PYTHONPATH"))}
    done = subprocess.run([sys.executable, "-m", "hotfix_testing.static_cache_mutants", *(m.name for m in mutants)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    return records_of(done, mutants, "on this transformers")


# the emulated capture's rules need the CPU's own torch; fp16 overflows alike on every device, and the simulated
# accelerator, which sees every op of its process, would make the tiny H3's many small ops several times slower
CPU_SCENARIOS = {"music3_graphs", "music3_graphs_gguf", "h3_fp16"}


def run_on_core(comfyui_env_python: str, tree: Path, mutants: list[Mutant]) -> list[dict]:
    """Runs ``mutants`` (all of one core, built at ``tree``) in one process, on the simulated accelerator unless
    their scenarios run on the CPU."""
    on_device = {mutant.scenario not in CPU_SCENARIOS for mutant in mutants}
    if len(on_device) != 1:
        raise ValueError("mutants of one run either all need the simulated accelerator or none does")
    # the child imports the core, the pack (tools/minimax_hotfix), this folder and, on the device, its torch_npu
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*([str(TESTS / "simulated_device")] if on_device == {True}
                                                          else []), str(tree), str(TESTS.parent / "tools"),
                                                        str(TESTS)]),
           "MINIMAX_HOTFIX_MUTANTS_DEVICE": "simulated" if on_device == {True} else "cpu"}
    done = subprocess.run([comfyui_env_python, str(HERE / "mutant_runs.py"), str(tree), *(m.name for m in mutants)],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=900, check=False)
    return records_of(done, mutants, f"on {tree}")

