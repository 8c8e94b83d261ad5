"""transformers_static_cache: transformers ``generate()`` with a static cache keeps nested attention masks on the host,
and tensor parallelism divides KV heads that the plan does not shard.

Bug 1: a custom node (captioner, prompt enhancer) calls ``model.generate(**inputs, cache_implementation="static")``
with the tokenizer's inputs on the CPU and the model on the GPU. ``prepare_inputs_for_generation`` moves only the
top-level tensors to the model device, but with a compilable cache and a config with ``layer_types`` (Gemma 3,
Qwen3, Qwen3.5) the attention mask is a dict keyed by layer type, whose tensors stay on the host:
RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!
(``scaled_dot_product_attention``; on other accelerators ``neuron:0 and cpu``, or ``attn_bias is on cpu, different from other tensors on cuda:0``).
Bug 2: with ``prefill_chunk_size`` and tensor parallelism, ``_get_static_cache_init_shape`` divides the KV heads by
the TP size even when the plan leaves k/v whole (no attention entry, ``colwise_gather_output``, MLP only), so the
eagerly initialized cache is too small:
ValueError: Incompatible shapes for broadcasting: (1, 8, 512, 128) and requested shape (1, 4, 512, 128)

Upstream: huggingface/transformers PR #46590 added the top-level-only move (5.13.1); #47019 made single-pattern
configs return the dict too. Fixed in 5.20.2 (``pytorch_utils.move_to_device`` recurses into dicts, lists and tuples;
``distributed.tensor_parallel.get_kv_heads_per_rank`` divides only for a ``colwise`` key projection).

Applies to: transformers 5.13.1 to 5.19.0 (5.20.0/5.20.1 unchecked), in any ComfyUI: ComfyUI never calls
``generate()`` with a static cache itself, custom nodes in the same process do.

Detection ("fixed upstream"): behavioural, on first use. Importing transformers' generation code takes about 2 s, far
over the pack's import budget, so on releases 5.13.1 to 5.20.1 (read from the package metadata) the pack installs two
pass-through wrappers at load without importing transformers (at once if ``transformers.generation.utils`` is already imported, else when it is). The first call of either
wrapper probes the real, unwrapped methods once on a tiny Qwen3 built on ``meta`` (mostly the time to import Qwen3;
no weights are drawn, so a user's ``torch.manual_seed`` before that first ``generate()`` still gives the same ids):
``prepare_inputs_for_generation`` with host-side inputs, a ``StaticCache`` and the model on a
FakeTensor ``cuda`` device (do the nested masks reach ``cuda``?), and ``_get_static_cache_init_shape`` with a TP size
of 2 and an MLP-only plan (are the 2 KV heads kept?). Each wrapper repairs only if its probe shows the bug (the masks
only when the main input is off the model device, the condition 5.20.2+ moves under), and the verdict is logged
once. Where neither bug shows (5.20.2+), the wrappers remove themselves. A probe that fails on drifted code leaves
its half off (FAILED) and says so in the log.

Off switch: ``MINIMAX_HOTFIX_DISABLE=transformers_static_cache`` (also honoured on every wrapped call, through
the registry's ``FIX.link``).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
import sys
import threading
from dataclasses import dataclass
from typing import Callable

from ..kernels.transformers_static_cache import (INIT_SHAPE, MLP_ONLY_PLAN, PREPARE_INPUTS, PROBE_KV_HEADS,
                                                 UnshardedView, kv_heads_per_rank, move_nested, prepare_on_fake_cuda,
                                                 main_generation_input, shards_kv_heads)
from ..registry.contract import Fix, Retirement, State, Status, Target, package_version
from ..registry.on_import import WrapOnImport

FIX_ID = "transformers_static_cache"
GENERATION_MODULE = "transformers.generation.utils"
# Set on each wrapper; holds the function it wraps.
WRAPPED = "_minimax_hotfix_wrapped"


@dataclass(frozen=True)
class Verdict:
    """What the probes found in the running transformers, per repair."""

    masks: Status
    tp_heads: Status

    def needs_repair(self) -> bool:
        return State.APPLIED in (self.masks.state, self.tp_heads.state)

    def combined(self) -> Status:
        order = (State.APPLIED, State.FAILED, State.FIXED_UPSTREAM, State.NOT_AFFECTED, State.NOT_APPLICABLE)
        state = min((self.masks.state, self.tp_heads.state), key=order.index)
        return Status(state, f"transformers {_transformers_version()}: nested masks: {self.masks.reason}; "
                             f"TP KV heads: {self.tp_heads.reason}")


_lock = threading.RLock()
_verdict: Verdict | None = None
_import_hook: WrapOnImport | None = None


def _transformers_version() -> str:
    return package_version("transformers")


# The releases the guard is installed on: from the first with either bug to the first with both fixed (5.20.0 and
# 5.20.1 were not checked, so they are included). A cheap pre-filter only; inside it the first use still probes the
# behaviour before repairing anything, and the doctor's self-test probes every version.
FIRST_AFFECTED, FIRST_FIXED = (5, 13, 1), (5, 20, 2)


def _release(version: str) -> tuple[int, ...] | None:
    numbers = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(n or 0) for n in numbers.groups()) if numbers else None


def unwrapped(mixin, name: str):
    function = mixin.__dict__.get(name)
    return getattr(function, WRAPPED, function)


def _probe_masks(mixin) -> Status:
    moved, nested = prepare_on_fake_cuda(unwrapped(mixin, PREPARE_INPUTS))
    if not moved:
        return Status(State.NOT_AFFECTED, "generate() does not move host-side inputs here at all (they must be on "
                                          "the model device already), so nested ones are no different")
    if not nested:
        return Status(State.NOT_AFFECTED, "static-cache masks are not nested here")
    if all(device.type == "cuda" for device in nested):
        return Status(State.FIXED_UPSTREAM, "nested tensors reach the model device")
    return Status(State.APPLIED, "repaired: tensors nested in generation inputs (per-layer-type masks) stay on the "
                                 "host; the pack moves them to the model device")


def _probe_tp_heads(mixin) -> Status:
    init_shape = unwrapped(mixin, INIT_SHAPE)
    if init_shape is None:
        return Status(State.NOT_APPLICABLE, f"no {INIT_SHAPE} (static caches are not initialized early here)")
    heads = kv_heads_per_rank(init_shape, MLP_ONLY_PLAN)
    if heads == PROBE_KV_HEADS:
        return Status(State.FIXED_UPSTREAM, "divided only when k/v are sharded")
    if heads == PROBE_KV_HEADS // 2:
        return Status(State.APPLIED, "repaired: divided by the TP size even when the plan does not shard k/v; the "
                                     "pack divides only for a colwise key projection")
    return Status(State.FAILED, f"target drifted: {INIT_SHAPE} gave {heads} heads for a plan that does not "
                                  f"shard k/v (expected {PROBE_KV_HEADS}, or {PROBE_KV_HEADS // 2} with the bug)")


def _probed(probe, mixin) -> Status:
    try:
        return probe(mixin)
    except Exception as exc:  # drifted internals must switch this half off, never break generate()
        return Status(State.FAILED, f"target drifted, left off: probe failed ({type(exc).__name__}: {exc})")


def verdict() -> Verdict:
    """The probes' verdict for the running transformers, computed once (imports transformers' generation code)."""
    global _verdict
    with _lock:
        if _verdict is None:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from transformers.generation.utils import GenerationMixin

            with unset_fake_temporarily():  # the first generate() may run under a caller's FakeTensorMode
                found = Verdict(_probed(_probe_masks, GenerationMixin), _probed(_probe_tp_heads, GenerationMixin))
            _verdict = found
            # The registry logs a status when it changes and would log the verdict again the next time it asks
            # (detect() now answers with it), so the verdict goes to the log through the registry, once.
            FIX.link.refresh_status()
        return _verdict


def _repairing(half: str) -> bool:
    """Whether a wrapper repairs ``half`` now: not switched off, and the probe found that bug. Where the probe finds
    nothing to repair the wrappers remove themselves, leaving transformers exactly as it ships."""
    if FIX.link.switched_off():
        return False
    found = verdict()
    if not found.needs_repair():
        FIX.uninstall()
        return False
    return getattr(found, half).state is State.APPLIED


def prepare_inputs_wrapper(original, repairing: Callable[[str], bool]):
    """``prepare_inputs_for_generation`` that also moves the nested inputs to the model device while
    ``repairing("masks")``."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def prepare_inputs_for_generation(self, *args, **kwargs):
        model_inputs = original(self, *args, **kwargs)
        if not repairing("masks"):
            return model_inputs
        device = self.device
        main_input = main_generation_input(signature.bind_partial(self, *args, **kwargs).arguments, model_inputs)
        # Upstream's condition (5.20.2+): inputs are moved only when the main one is off the model device; a caller
        # may keep them elsewhere on purpose (Neuron/TPU), and transformers never moves inputs to a meta model.
        if device.type == "meta" or main_input is None or main_input.device == device:
            return model_inputs
        for key, value in model_inputs.items():
            if isinstance(value, (dict, list, tuple)):
                model_inputs[key] = move_nested(value, device)
        return model_inputs

    return prepare_inputs_for_generation


def init_shape_wrapper(original, repairing: Callable[[str], bool]):
    """``_get_static_cache_init_shape`` that divides the KV heads only for a sharded key projection while
    ``repairing("tp_heads")``."""
    @functools.wraps(original)
    def _get_static_cache_init_shape(self, *args, **kwargs):
        if ((getattr(self, "_tp_size", None) or 1) > 1 and not shards_kv_heads(getattr(self, "tp_plan", None))
                and repairing("tp_heads")):
            return original(UnshardedView(self), *args, **kwargs)
        return original(self, *args, **kwargs)

    return _get_static_cache_init_shape


WRAPPERS = {PREPARE_INPUTS: prepare_inputs_wrapper, INIT_SHAPE: init_shape_wrapper}


def _wrap_generation(module) -> None:
    mixin = module.GenerationMixin
    for name, make_wrapper in WRAPPERS.items():
        current = mixin.__dict__.get(name)
        if current is None or hasattr(current, WRAPPED):
            continue
        wrapper = make_wrapper(current, _repairing)
        setattr(wrapper, WRAPPED, current)
        setattr(mixin, name, wrapper)


def _unwrap_generation(module) -> None:
    mixin = module.GenerationMixin
    for name in WRAPPERS:
        current = mixin.__dict__.get(name)
        if hasattr(current, WRAPPED):
            setattr(mixin, name, getattr(current, WRAPPED))


class TransformersStaticCacheFix(Fix):
    id = FIX_ID
    title = "transformers generate() with a static cache: nested masks to the model device, TP KV heads"
    targets = (Target.PROCESS,)
    upstream = "huggingface/transformers PR #46590 / #47019 (bug), fixed in 5.20.2"
    retirement = Retirement(
        fixed_by="transformers 5.20.2 (pytorch_utils.move_to_device recurses into containers; get_kv_heads_per_rank "
                 "divides only for a colwise key projection)",
        delete_when="the pack no longer supports transformers 5.13.1 to 5.20.1")

    def detect(self) -> Status:
        if importlib.util.find_spec("transformers") is None:
            return Status(State.NOT_APPLICABLE, "transformers is not installed")
        if _verdict is not None:
            return _verdict.combined()
        version = _transformers_version()
        release = _release(version)
        if release is not None and release >= FIRST_FIXED:
            return Status(State.FIXED_UPSTREAM, f"transformers {version} moves nested generation inputs and divides KV "
                                                "heads only for sharded k/v (5.20.2+); no guard installed (the "
                                                "doctor's self-test probes the behaviour)")
        if release is not None and release < FIRST_AFFECTED:
            return Status(State.NOT_APPLICABLE, f"transformers {version} predates the per-layer-type static-cache "
                                                "masks and the TP early cache init (5.13.1)")
        return Status(State.APPLIED, f"transformers {_transformers_version()}: pass-through guard installed; its "
                                     "first generate() probes the real code once and repairs only what is broken "
                                     "(the doctor's self-test shows the verdict)", provisional=True)

    def install(self) -> None:
        global _import_hook
        with _lock:
            if _verdict is not None and not _verdict.needs_repair():
                return
            module = sys.modules.get(GENERATION_MODULE)
            if module is not None:
                _wrap_generation(module)
            elif _import_hook is None:
                _import_hook = WrapOnImport(GENERATION_MODULE, _wrap_generation)
                sys.meta_path.insert(0, _import_hook)

    def uninstall(self) -> None:
        global _import_hook
        with _lock:
            if _import_hook is not None:
                if _import_hook in sys.meta_path:
                    sys.meta_path.remove(_import_hook)
                _import_hook = None
            module = sys.modules.get(GENERATION_MODULE)
            if module is not None:
                _unwrap_generation(module)


FIX = TransformersStaticCacheFix()
