"""transformers_static_cache: transformers ``generate()`` with a static cache keeps nested attention masks on the host,
and tensor parallelism divides KV heads that the plan does not shard.

Bug 1: a custom node (captioner, prompt enhancer) calls ``model.generate(**inputs, cache_implementation="static")``
with the tokenizer's inputs on the CPU and the model on the GPU. ``prepare_inputs_for_generation`` moves only the
top-level tensors to the model device, but with a compilable cache and a config with ``layer_types`` (Gemma 3,
Qwen3, Qwen3.5) the attention mask is a dict keyed by layer type, whose tensors stay on the host:
``RuntimeError: ... found at least two devices, cuda:0 and cpu!`` (``scaled_dot_product_attention``; on other
accelerators ``neuron:0 and cpu``, or ``attn_bias is on cpu, different from other tensors on cuda:0``).
Bug 2: with ``prefill_chunk_size`` and tensor parallelism, ``_get_static_cache_init_shape`` divides the KV heads by
the TP size even when the plan leaves k/v whole (no attention entry, ``colwise_gather_output``, MLP only), so the
eagerly initialized cache is too small: ``ValueError: Incompatible shapes for broadcasting: (1, 8, 512, 128) and
requested shape (1, 4, 512, 128)``.

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

Off switch: ``MINIMAX_HOTFIX_DISABLE=transformers_static_cache`` (also read on every wrapped call).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.metadata
import importlib.util
import inspect
import re
import sys
import threading
import warnings
from dataclasses import dataclass

from ..kernels.nested_tensors import move_nested, nested_tensors
from . import status
from ._fix import Check, Fix, State, Status

FIX_ID = "transformers_static_cache"
GENERATION_MODULE = "transformers.generation.utils"
PREPARE_INPUTS = "prepare_inputs_for_generation"
INIT_SHAPE = "_get_static_cache_init_shape"
# The projections whose output holds the keys, fused or not; a "colwise" one splits the KV heads across ranks
# (the rule transformers 5.20.2+ applies in get_kv_heads_per_rank).
KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")
SHARDING_STYLE = "colwise"
# Set on each wrapper; holds the function it wraps.
WRAPPED = "_minimax_hotfix_wrapped"
# The probe's TP plans: MLP-only leaves the 2 KV heads whole; colwise k/v splits them 1 per rank.
MLP_ONLY_PLAN = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                 "model.layers.*.mlp.down_proj": "rowwise"}
KV_SHARDED_PLAN = {"model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.v_proj": "colwise"}
PROBE_KV_HEADS = 2


def shards_kv_heads(tp_plan) -> bool:
    """Whether a TP plan splits the attention KV heads across ranks (a column-sharded key projection)."""
    return any(key.rsplit(".", 1)[-1] in KEY_PROJECTIONS and style == SHARDING_STYLE
               for key, style in (tp_plan or {}).items())


class _UnshardedView:
    """A model as ``_get_static_cache_init_shape`` should see it when the plan leaves k/v whole: TP size unset,
    every other attribute the model's own. The model itself is never modified."""

    _tp_size = None

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)


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
_import_hook: _WrapOnImport | None = None


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# The releases the guard is installed on: from the first with either bug to the first with both fixed (5.20.0 and
# 5.20.1 were not checked, so they are included). A cheap pre-filter only; inside it the first use still probes the
# behaviour before repairing anything, and the doctor's self-test probes every version.
FIRST_AFFECTED, FIRST_FIXED = (5, 13, 1), (5, 20, 2)


def _release(version: str) -> tuple[int, ...] | None:
    numbers = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(n or 0) for n in numbers.groups()) if numbers else None


def _unwrapped(mixin, name: str):
    function = mixin.__dict__.get(name)
    return getattr(function, WRAPPED, function)


# -- the probes -------------------------------------------------------------------------------------------------

def _probe_model():
    """A tiny Qwen3 (its config has ``layer_types``, so static-cache masks come as a dict) on ``meta``: the probes
    read shapes and devices only. No weight is drawn, so the user's random state is left as it was: the probe runs
    inside the user's first ``generate()``, after a ``torch.manual_seed`` that its sampling relies on."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=PROBE_KV_HEADS, head_dim=8,
                         max_position_embeddings=32)
    with torch.device("meta"):
        return Qwen3ForCausalLM(config).eval()


def to_fake_cuda(model, mode) -> None:
    """Replace every parameter and buffer of ``model`` by a FakeTensor on ``cuda:0`` (shape and dtype kept)."""
    import torch

    from ._devices import on_fake_cuda

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(on_fake_cuda(mode, param), requires_grad=False)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = on_fake_cuda(mode, buffer)


def prepare_on_fake_cuda(prepare_inputs) -> tuple[bool, list]:
    """Call ``prepare_inputs(model, ...)`` on a tiny Qwen3 on FakeTensor ``cuda`` with host-side, left-padded inputs
    and a static cache, as ``generate()`` does at prefill. Returns (top-level inputs moved to ``cuda``, the devices
    of the tensors nested in the returned inputs)."""
    import torch
    from transformers.cache_utils import StaticCache

    from ._devices import fake_cuda_mode

    model = _probe_model()
    parameters = inspect.signature(prepare_inputs).parameters
    cache_name = next((name for name in ("cache", "past_key_values") if name in parameters), None)
    if cache_name is None:
        raise TypeError(f"{PREPARE_INPUTS} takes neither `cache` nor `past_key_values`")
    kwargs = {cache_name: StaticCache(config=model.config, max_cache_len=8),
              "attention_mask": torch.tensor([[0, 1, 1]])}
    if "is_first_iteration" in parameters:
        kwargs["is_first_iteration"] = True
    with fake_cuda_mode() as mode:
        to_fake_cuda(model, mode)
        model_inputs = prepare_inputs(model, torch.tensor([[1, 2, 3]]), **kwargs)
    on_model_device = model_inputs["input_ids"].device.type == "cuda"
    nested = [tensor.device for value in model_inputs.values() for tensor in nested_tensors(value)]
    return on_model_device, nested


def kv_heads_per_rank(init_shape, tp_plan) -> int | None:
    """The KV heads ``init_shape`` (a ``_get_static_cache_init_shape``) gives each of 2 TP ranks of a tiny Qwen3
    with 2 KV heads under ``tp_plan``, with no distributed init; None where it declines to initialize."""
    model = _probe_model()
    model._tp_size = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the setter warns about plan entries that match no parameter
        model.tp_plan = dict(tp_plan)
    if dict(model.tp_plan) != dict(tp_plan):
        raise TypeError("setting `tp_plan` on a model no longer replaces its plan")
    shape = init_shape(model)
    return None if shape is None else shape[0]


def _probe_masks(mixin) -> Status:
    moved, nested = prepare_on_fake_cuda(_unwrapped(mixin, PREPARE_INPUTS))
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
    init_shape = _unwrapped(mixin, INIT_SHAPE)
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
            status(FIX)
        return _verdict


def _repairing(half: str) -> bool:
    """Whether a wrapper repairs ``half`` now: not switched off, and the probe found that bug. Where the probe finds
    nothing to repair the wrappers remove themselves, leaving transformers exactly as it ships."""
    from . import switched_off

    if switched_off(FIX_ID):
        return False
    found = verdict()
    if not found.needs_repair():
        FIX.uninstall()
        return False
    return getattr(found, half).state is State.APPLIED


def _always(half: str) -> bool:
    """The self-test's ``repairing``: the repair itself, whatever the verdict and the off switch say."""
    return True


# -- the wrappers -----------------------------------------------------------------------------------------------

def _main_input(arguments: dict, model_inputs: dict):
    """The input whose device decides whether ``prepare_inputs_for_generation`` moves the rest (the embeddings where
    this step uses them, else the ids), as the caller passed it: the returned one has already been moved."""
    return arguments.get("inputs_embeds") if "inputs_embeds" in model_inputs else arguments.get("input_ids")


def _prepare_inputs_wrapper(original, repairing=_repairing):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def prepare_inputs_for_generation(self, *args, **kwargs):
        model_inputs = original(self, *args, **kwargs)
        if not repairing("masks"):
            return model_inputs
        device = self.device
        main_input = _main_input(signature.bind_partial(self, *args, **kwargs).arguments, model_inputs)
        # Upstream's condition (5.20.2+): inputs are moved only when the main one is off the model device; a caller
        # may keep them elsewhere on purpose (Neuron/TPU), and transformers never moves inputs to a meta model.
        if device.type == "meta" or main_input is None or main_input.device == device:
            return model_inputs
        for key, value in model_inputs.items():
            if isinstance(value, (dict, list, tuple)):
                model_inputs[key] = move_nested(value, device)
        return model_inputs

    return prepare_inputs_for_generation


def _init_shape_wrapper(original, repairing=_repairing):
    @functools.wraps(original)
    def _get_static_cache_init_shape(self, *args, **kwargs):
        if ((getattr(self, "_tp_size", None) or 1) > 1 and not shards_kv_heads(getattr(self, "tp_plan", None))
                and repairing("tp_heads")):
            return original(_UnshardedView(self), *args, **kwargs)
        return original(self, *args, **kwargs)

    return _get_static_cache_init_shape


WRAPPERS = {PREPARE_INPUTS: _prepare_inputs_wrapper, INIT_SHAPE: _init_shape_wrapper}


def _wrap_generation(module) -> None:
    mixin = module.GenerationMixin
    for name, make_wrapper in WRAPPERS.items():
        current = mixin.__dict__.get(name)
        if current is None or hasattr(current, WRAPPED):
            continue
        wrapper = make_wrapper(current)
        setattr(wrapper, WRAPPED, current)
        setattr(mixin, name, wrapper)


def _unwrap_generation(module) -> None:
    mixin = module.GenerationMixin
    for name in WRAPPERS:
        current = mixin.__dict__.get(name)
        if hasattr(current, WRAPPED):
            setattr(mixin, name, getattr(current, WRAPPED))


class _WrapAfterExec(importlib.abc.Loader):
    """Runs the real loader, then wraps the freshly executed module; everything else goes to the real loader."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _wrap_generation(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps GenerationMixin the moment ``transformers.generation.utils`` is imported, so the pack never imports it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != GENERATION_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _WrapAfterExec(spec.loader)
                return spec
        return None


class TransformersStaticCacheFix(Fix):
    id = FIX_ID
    title = "transformers generate() with a static cache: nested masks to the model device, TP KV heads"
    targets = ("process",)
    upstream = "huggingface/transformers PR #46590 / #47019 (bug), fixed in 5.20.2"

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
                _import_hook = _WrapOnImport()
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

    def self_test(self):
        if importlib.util.find_spec("transformers") is None:
            return
        from transformers.generation.utils import GenerationMixin

        found = verdict()
        yield Check("verdict", found.masks.state is not State.FAILED and found.tp_heads.state is not State.FAILED,
                    found.combined().reason)
        prepare = _unwrapped(GenerationMixin, PREPARE_INPUTS)
        if found.masks.state is State.APPLIED:
            _, nested = prepare_on_fake_cuda(prepare)
            yield Check("red: without the fix, nested masks stay on the host", any(d.type == "cpu" for d in nested),
                        f"nested devices {sorted({str(d) for d in nested})}")
        if found.masks.state in (State.APPLIED, State.FIXED_UPSTREAM):
            moved, nested = prepare_on_fake_cuda(_prepare_inputs_wrapper(prepare, _always))
            yield Check("green: with the fix, every input is on the model device",
                        moved and bool(nested) and all(d.type == "cuda" for d in nested),
                        f"nested devices {sorted({str(d) for d in nested})}")
        init_shape = _unwrapped(GenerationMixin, INIT_SHAPE)
        if found.tp_heads.state is State.APPLIED:
            heads = kv_heads_per_rank(init_shape, MLP_ONLY_PLAN)
            yield Check("red: without the fix, an MLP-only TP plan halves the KV heads", heads == 1, f"{heads} heads")
        if found.tp_heads.state in (State.APPLIED, State.FIXED_UPSTREAM):
            fixed = _init_shape_wrapper(init_shape, _always)
            kept, split = kv_heads_per_rank(fixed, MLP_ONLY_PLAN), kv_heads_per_rank(fixed, KV_SHARDED_PLAN)
            yield Check("green: with the fix, KV heads are divided only for colwise k/v", (kept, split) == (2, 1),
                        f"MLP-only plan {kept} heads per rank, colwise k/v {split}")


FIX = TransformersStaticCacheFix()
