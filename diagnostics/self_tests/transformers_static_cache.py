"""Self-test of transformers_static_cache: the probes' verdict on the running transformers, then, for each half the
probe found broken, the unwrapped method shows the bug (red) and the repair, run unconditionally, fixes it (green)."""

from __future__ import annotations

import importlib.util

from ...contract import Check, State
from ...kernels.transformers_static_cache import (
    INIT_SHAPE,
    KV_SHARDED_PLAN,
    MLP_ONLY_PLAN,
    PREPARE_INPUTS,
    init_shape_wrapper,
    kv_heads_per_rank,
    prepare_inputs_wrapper,
    prepare_on_fake_cuda,
    unwrapped,
)
from ...patches.transformers_static_cache import FIX


def repair_regardless(half: str) -> bool:
    """The self-test's ``repairing``: the repair itself, whatever the verdict and the off switch say."""
    return True


def self_test():
    if importlib.util.find_spec("transformers") is None:
        return
    from transformers.generation.utils import GenerationMixin

    found = FIX.verdict()
    yield Check("verdict", found.masks.state is not State.FAILED and found.tp_heads.state is not State.FAILED,
                found.combined().reason)
    prepare = unwrapped(GenerationMixin, PREPARE_INPUTS)
    if found.masks.state is State.NEEDED:
        _, nested = prepare_on_fake_cuda(prepare)
        yield Check("red: without the fix, nested masks stay on the host", any(d.type == "cpu" for d in nested),
                    f"nested devices {sorted({str(d) for d in nested})}")
    if found.masks.state in (State.NEEDED, State.FIXED_UPSTREAM):
        moved, nested = prepare_on_fake_cuda(prepare_inputs_wrapper(prepare, repair_regardless))
        yield Check("green: with the fix, every input is on the model device",
                    moved and bool(nested) and all(d.type == "cuda" for d in nested),
                    f"nested devices {sorted({str(d) for d in nested})}")
    init_shape = unwrapped(GenerationMixin, INIT_SHAPE)
    if found.tp_heads.state is State.NEEDED:
        heads = kv_heads_per_rank(init_shape, MLP_ONLY_PLAN)
        yield Check("red: without the fix, an MLP-only TP plan halves the KV heads", heads == 1, f"{heads} heads")
    if found.tp_heads.state in (State.NEEDED, State.FIXED_UPSTREAM):
        fixed = init_shape_wrapper(init_shape, repair_regardless)
        kept, split = kv_heads_per_rank(fixed, MLP_ONLY_PLAN), kv_heads_per_rank(fixed, KV_SHARDED_PLAN)
        yield Check("green: with the fix, KV heads are divided only for colwise k/v", (kept, split) == (2, 1),
                    f"MLP-only plan {kept} heads per rank, colwise k/v {split}")
