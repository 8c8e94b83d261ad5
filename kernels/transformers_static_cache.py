"""Helpers of the transformers_static_cache fix.

* ``move_nested`` / ``nested_tensors``: the tensors nested in a model's keyword inputs (dicts, lists, tuples), moved
  onto one device. Containers are rebuilt only where something moved, so an input that is already in place comes back
  as the same object. Anything that is not a tensor or one of those containers (a KV cache object, a config, a
  number) is returned untouched, never traversed: a cache owns its buffers and places them itself.
* ``shards_kv_heads`` and ``UnshardedView``: which TP plans split the KV heads, and a model seen with its TP size
  unset.
* the two wrappers of ``GenerationMixin`` (``wrap_generation``), each repairing only while the fix says so.
* the probes' tiny Qwen3 on ``meta`` and what they run on it: ``prepare_on_fake_cuda`` (where do generation inputs
  go?) and ``kv_heads_per_rank`` (how many KV heads does an early static cache give each TP rank?). transformers is
  imported only when a probe runs.
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from typing import Callable

import torch

PREPARE_INPUTS = "prepare_inputs_for_generation"
# Set on each wrapper; holds the function it wraps.
WRAPPED = "_minimax_hotfix_wrapped"
INIT_SHAPE = "_get_static_cache_init_shape"
# The probe's TP plans: MLP-only leaves the 2 KV heads whole; colwise k/v splits them 1 per rank.
MLP_ONLY_PLAN = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                 "model.layers.*.mlp.down_proj": "rowwise"}
KV_SHARDED_PLAN = {"model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.v_proj": "colwise"}
PROBE_KV_HEADS = 2
# The projections whose output holds the keys, fused or not; a "colwise" one splits the KV heads across ranks
# (the rule transformers 5.20.2+ applies in get_kv_heads_per_rank).
KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")
SHARDING_STYLE = "colwise"
TP_SIZE_PARAMETER = "tp_size"


def move_nested(value, device: torch.device):
    """``value`` with every tensor inside its dicts, lists and tuples on ``device``; ``value`` itself if none moved."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, dict):
        moved = {key: move_nested(item, device) for key, item in value.items()}
        if all(moved[key] is item for key, item in value.items()):
            return value
        # A shallow copy keeps a dict subclass's type and attributes (transformers' ModelOutput, BatchEncoding).
        rebuilt = copy.copy(value)
        for key, item in moved.items():
            if item is not value[key]:
                rebuilt[key] = item
        return rebuilt
    if isinstance(value, (list, tuple)):
        moved = [move_nested(item, device) for item in value]
        if all(new is old for new, old in zip(moved, value, strict=True)):
            return value
        if isinstance(value, list):
            rebuilt = copy.copy(value)
            rebuilt[:] = moved
            return rebuilt
        if hasattr(value, "_fields"):  # a namedtuple takes its items as separate arguments
            return type(value)(*moved)
        return type(value)(moved)
    return value


def nested_tensors(value):
    """The tensors inside ``value``'s dicts, lists and tuples, depth first (not ``value`` itself if it is one)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        else:
            yield from nested_tensors(item)


def probe_model():
    """A tiny Qwen3 (its config has ``layer_types``, so static-cache masks come as a dict) on ``meta``: the probes
    read shapes and devices only. No weight is drawn, so the user's random state is left as it was: the probe runs
    inside the user's first ``generate()``, after a ``torch.manual_seed`` that its sampling relies on."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=PROBE_KV_HEADS, head_dim=8,
                         max_position_embeddings=32)
    with torch.device("meta"):
        return Qwen3ForCausalLM(config).eval()


def to_fake_cuda(model, mode) -> None:
    """Replace every parameter and buffer of ``model`` by a FakeTensor on ``cuda:0`` (shape and dtype kept)."""
    from .fake_cuda import on_fake_cuda

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
    from transformers.cache_utils import StaticCache

    from .fake_cuda import fake_cuda_mode

    model = probe_model()
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
    model = probe_model()
    model._tp_size = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the setter warns about plan entries that match no parameter
        model.tp_plan = dict(tp_plan)
    if dict(model.tp_plan) != dict(tp_plan):
        raise TypeError("setting `tp_plan` on a model no longer replaces its plan")
    shape = init_shape(model)
    return None if shape is None else shape[0]


def shards_kv_heads(tp_plan) -> bool:
    """Whether a TP plan splits the attention KV heads across ranks (a column-sharded key projection)."""
    return any(key.rsplit(".", 1)[-1] in KEY_PROJECTIONS and style == SHARDING_STYLE
               for key, style in (tp_plan or {}).items())


class UnshardedView:
    """A model as ``_get_static_cache_init_shape`` should see it when the plan leaves k/v whole: TP size unset,
    every other attribute the model's own. The model itself is never modified."""

    _tp_size = None

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)


def main_generation_input(arguments: dict, model_inputs: dict):
    """The input whose device decides whether ``prepare_inputs_for_generation`` moves the rest (the embeddings where
    this step uses them, else the ids), as the caller passed it: the returned one has already been moved."""
    return arguments.get("inputs_embeds") if "inputs_embeds" in model_inputs else arguments.get("input_ids")


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
    ``repairing("tp_heads")``: it sees the model unsharded, and a TP size passed to it (a signature it may take in a
    later release) unset too."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_static_cache_init_shape(self, *args, **kwargs):
        if ((getattr(self, "_tp_size", None) or 1) > 1 and not shards_kv_heads(getattr(self, "tp_plan", None))
                and repairing("tp_heads")):
            bound = signature.bind(UnshardedView(self), *args, **kwargs)
            if TP_SIZE_PARAMETER in bound.arguments:
                bound.arguments[TP_SIZE_PARAMETER] = None
            return original(*bound.args, **bound.kwargs)
        return original(self, *args, **kwargs)

    return _get_static_cache_init_shape


WRAPPERS = {PREPARE_INPUTS: prepare_inputs_wrapper, INIT_SHAPE: init_shape_wrapper}


def wrap_generation(mixin, repairing: Callable[[str], bool]) -> None:
    """Wrap ``mixin``'s two methods once (a wrapper already there is kept); each wrapper repairs while ``repairing``."""
    for name, make_wrapper in WRAPPERS.items():
        current = mixin.__dict__.get(name)
        if current is None or hasattr(current, WRAPPED):
            continue
        wrapper = make_wrapper(current, repairing)
        setattr(wrapper, WRAPPED, current)
        setattr(mixin, name, wrapper)


def unwrapped(mixin, name: str):
    """``mixin``'s method ``name`` as transformers ships it."""
    function = mixin.__dict__.get(name)
    return getattr(function, WRAPPED, function)


def unwrap_generation(mixin) -> None:
    for name in WRAPPERS:
        current = mixin.__dict__.get(name)
        if hasattr(current, WRAPPED):
            setattr(mixin, name, getattr(current, WRAPPED))
