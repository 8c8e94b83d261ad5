"""transformers_static_cache: transformers ``generate()`` with a static cache keeps nested attention masks on the host,
and tensor parallelism divides KV heads that the plan does not shard.

Bug 1: a custom node (captioner, prompt enhancer) calls ``generate(**inputs, cache_implementation="static")`` with
host-side inputs and the model on the GPU; with a config with ``layer_types`` (Gemma 3, Qwen3, Qwen3.5) the mask is a
dict per layer type, and ``prepare_inputs_for_generation`` moves only top-level tensors:
RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!
(also ``neuron:0 and cpu``, or ``attn_bias is on cpu, different from other tensors on cuda:0``).
Bug 2: with ``prefill_chunk_size`` and tensor parallelism, ``_get_static_cache_init_shape`` divides the KV heads by
the TP size even when the plan leaves k/v whole, so the early cache is too small:
ValueError: Incompatible shapes for broadcasting: (1, 8, 512, 128) and requested shape (1, 4, 512, 128)

Upstream: huggingface/transformers PR #46590 added the top-level-only move (5.13.1); #47019 made single-pattern
configs return the dict too. Fixed in 5.20.2 (``pytorch_utils.move_to_device`` recurses into dicts, lists and tuples;
``distributed.tensor_parallel.get_kv_heads_per_rank`` divides only for a ``colwise`` key projection).

Applies to: transformers 5.13.1 to 5.19.0 (5.20.0/5.20.1 unchecked), in any ComfyUI: ComfyUI never calls
``generate()`` with a static cache itself, custom nodes in the same process do.

Detection ("fixed upstream"): behavioural, on first use. Importing transformers' generation code takes ~2 s, so on
releases 5.13.1 to 5.20.1 (package metadata) two pass-through wrappers go in when that code is imported. Their first
call probes the real methods once on a tiny Qwen3 on ``meta`` / FakeTensor ``cuda`` (no weights drawn, so seeded
results stay as they were) and each repairs only the bug its probe shows; where neither shows they remove themselves.
A probe that fails on drifted code leaves its half off (failed) and logs it. docs/transformers_static_cache.md has the
details.

Off switch: ``MINIMAX_HOTFIX_DISABLE=transformers_static_cache`` (also honoured on every wrapped call, through
the registry's ``FIX.link``).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import threading
from typing import NamedTuple

from ..contract import Fix, Retirement, State, Status, Target, error_line, package_version
from ..contract.on_import import WrapOnImport

FIX_ID = "transformers_static_cache"
GENERATION_MODULE = "transformers.generation.utils"


class Verdict(NamedTuple):
    """What the probes found in the running transformers, per repair."""

    masks: Status
    tp_heads: Status

    def needs_repair(self) -> bool:
        return State.NEEDED in (self.masks.state, self.tp_heads.state)

    def combined(self) -> Status:
        order = (State.NEEDED, State.FAILED, State.FIXED_UPSTREAM, State.NOT_AFFECTED, State.NOT_APPLICABLE)
        state = min((self.masks.state, self.tp_heads.state), key=order.index)
        return Status(state, f"transformers {_transformers_version()}: nested masks: {self.masks.reason}; "
                             f"TP KV heads: {self.tp_heads.reason}")


def _transformers_version() -> str:
    return package_version("transformers")


# The releases the guard is installed on: from the first with either bug to the first with both fixed (5.20.0 and
# 5.20.1 were not checked, so they are included). A cheap pre-filter only; inside it the first use still probes the
# behaviour before repairing anything, and the doctor's self-test probes every version.
FIRST_AFFECTED, FIRST_FIXED = (5, 13, 1), (5, 20, 2)


def _release(version: str) -> tuple[int, ...] | None:
    numbers = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(n or 0) for n in numbers.groups()) if numbers else None


def _kernel():
    """The probes and wrappers (kernels/transformers_static_cache.py), needed once transformers' generation code is
    imported: ComfyUI's start-up does not load them."""
    return importlib.import_module("..kernels.transformers_static_cache", __package__)


def _probe_masks(mixin) -> Status:
    kernel = _kernel()
    moved, nested = kernel.prepare_on_fake_cuda(kernel.unwrapped(mixin, kernel.PREPARE_INPUTS))
    if not moved:
        return Status(State.NOT_AFFECTED, "generate() does not move host-side inputs here at all (they must be on "
                                          "the model device already), so nested ones are no different")
    if not nested:
        return Status(State.NOT_AFFECTED, "static-cache masks are not nested here")
    if all(device.type == "cuda" for device in nested):
        return Status(State.FIXED_UPSTREAM, "nested tensors reach the model device")
    return Status(State.NEEDED, "repaired: tensors nested in generation inputs (per-layer-type masks) stay on the "
                                 "host; the pack moves them to the model device")


def _probe_tp_heads(mixin) -> Status:
    kernel = _kernel()
    init_shape, expected = kernel.unwrapped(mixin, kernel.INIT_SHAPE), kernel.PROBE_KV_HEADS
    if init_shape is None:
        return Status(State.NOT_APPLICABLE, f"no {kernel.INIT_SHAPE} (static caches are not initialized early here)")
    heads = kernel.kv_heads_per_rank(init_shape, kernel.MLP_ONLY_PLAN)
    if heads == expected:
        return Status(State.FIXED_UPSTREAM, "divided only when k/v are sharded")
    if heads == expected // 2:
        return Status(State.NEEDED, "repaired: divided by the TP size even when the plan does not shard k/v; the "
                                     "pack divides only for a colwise key projection")
    return Status(State.FAILED, f"target drifted: {kernel.INIT_SHAPE} gave {heads} heads for a plan that does not "
                                  f"shard k/v (expected {expected}, or {expected // 2} with the bug)")


def _probed(probe, mixin) -> Status:
    try:
        return probe(mixin)
    except Exception as exc:  # drifted internals must switch this half off, never break generate()
        return Status(State.FAILED, f"target drifted, left off: probe failed ({error_line(exc)})")


class TransformersStaticCacheFix(Fix):
    id = FIX_ID
    targets = (Target.PROCESS,)
    retirement = Retirement(
        fixed_by="transformers 5.20.2 (pytorch_utils.move_to_device recurses into containers; get_kv_heads_per_rank "
                 "divides only for a colwise key projection)",
        delete_when="the pack no longer supports transformers 5.13.1 to 5.20.1")

    def __init__(self):
        self._lock = threading.RLock()
        self._verdict: Verdict | None = None
        self._import_hook: WrapOnImport | None = None

    def verdict(self) -> Verdict:
        """The probes' verdict for the running transformers, computed once (imports transformers' generation code)."""
        with self._lock:
            if self._verdict is None:
                from torch._subclasses.fake_tensor import unset_fake_temporarily
                from transformers.generation.utils import GenerationMixin

                with unset_fake_temporarily():  # the first generate() may run under a caller's FakeTensorMode
                    found = Verdict(_probed(_probe_masks, GenerationMixin), _probed(_probe_tp_heads, GenerationMixin))
                self._verdict = found
                # The registry logs a status when it changes and would log the verdict again the next time it asks
                # (detect() now answers with it), so the verdict goes to the log through the registry, once.
                self.link.refresh_status()
            return self._verdict

    def repairing(self, half: str) -> bool:
        """Whether a wrapper repairs ``half`` now: not switched off, and the probe found that bug. Where the probe
        finds nothing to repair the wrappers remove themselves, leaving transformers exactly as it ships."""
        if self.link.switched_off():
            return False
        found = self.verdict()
        if not found.needs_repair():
            self.uninstall()
            return False
        return getattr(found, half).state is State.NEEDED

    def _wrap(self, generation_module) -> None:
        _kernel().wrap_generation(generation_module.GenerationMixin, self.repairing)

    def detect(self) -> Status:
        if importlib.util.find_spec("transformers") is None:
            return Status(State.NOT_APPLICABLE, "transformers is not installed")
        if self._verdict is not None:
            return self._verdict.combined()
        version = _transformers_version()
        release = _release(version)
        if release is not None and release >= FIRST_FIXED:
            return Status(State.FIXED_UPSTREAM, f"transformers {version} moves nested generation inputs and divides KV "
                                                "heads only for sharded k/v (5.20.2+); no guard installed (the "
                                                "doctor's self-test probes the behaviour)")
        if release is not None and release < FIRST_AFFECTED:
            return Status(State.NOT_APPLICABLE, f"transformers {version} predates the per-layer-type static-cache "
                                                "masks and the TP early cache init (5.13.1)")
        return Status(State.NEEDED, f"transformers {_transformers_version()}: pass-through guard installed; its "
                                     "first generate() probes the real code once and repairs only what is broken "
                                     "(the doctor's self-test shows the verdict)", provisional=True)

    def install(self) -> None:
        with self._lock:
            if self._verdict is not None and not self._verdict.needs_repair():
                return
            module = sys.modules.get(GENERATION_MODULE)
            if module is not None:
                self._wrap(module)
            elif self._import_hook is None:
                self._import_hook = WrapOnImport(GENERATION_MODULE, self._wrap)
                sys.meta_path.insert(0, self._import_hook)

    def uninstall(self) -> None:
        with self._lock:
            if self._import_hook is not None:
                if self._import_hook in sys.meta_path:
                    sys.meta_path.remove(self._import_hook)
                self._import_hook = None
            module = sys.modules.get(GENERATION_MODULE)
            if module is not None:
                _kernel().unwrap_generation(module.GenerationMixin)


FIX = TransformersStaticCacheFix()
