"""transformers_static_cache: nested generation inputs reach the model device, TP KV heads divided only when sharded.

Two transformers versions take part. The ``test_affected_*`` tests need transformers 5.19.0 (both bugs present):
``test_transformers_5_19_subprocess`` runs them in a subprocess with ``.venv/extra/transformers-5.19``
(installed by tools/venv.sh from tests/requirements-transformers-5.19.txt) first on PYTHONPATH. The ``test_latest_*``
tests run on the venv's own (latest) transformers, where both bugs are fixed upstream and the shim must do nothing.

The "model on a GPU" is FakeTensor ``cuda``: a device mix raises the same "found at least two devices, cuda:0 and
cpu" as CUDA. The host side of ``generate()`` (token bookkeeping, stopping criteria) stays real; only the model's
own work (``prepare_inputs_for_generation`` and ``forward``) runs in the fake mode, and ``forward`` hands back zero
logits on the host, as a device model's would be copied back.
"""

import collections
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from hotfix_testing import child_pythonpath
from hotfix_testing.generate_on_simulated_device import GENERATE, PADDED, PROMPT, TINY_MODELS, tiny_qwen3
from minimax_hotfix import registry as pack_registry
from minimax_hotfix.contract import State
from minimax_hotfix.diagnostics import self_test
from minimax_hotfix.kernels import transformers_static_cache as static_cache_kernels
from minimax_hotfix.kernels.fake_cuda import fake_cuda_mode
from minimax_hotfix.kernels.transformers_static_cache import move_nested, nested_tensors
from minimax_hotfix.patches import transformers_static_cache as shim
from minimax_hotfix.registry.status_table import status_rows

pytestmark = [pytest.mark.filterwarnings("ignore:You are calling .generate:UserWarning"),  # host inputs on purpose
              pytest.mark.usefixtures("fresh_detection")]

ROOT = Path(__file__).resolve().parents[1]
AFFECTED = "5.19"
AFFECTED_PIN = (ROOT / f"tests/requirements-transformers-{AFFECTED}.txt").read_text()
AFFECTED_VERSION = re.search(r"^transformers==(\S+)", AFFECTED_PIN, re.M).group(1)

affected_only = pytest.mark.transformers(AFFECTED)  # tools/test.sh runs them with that transformers on the path

MISMATCH = "found at least two devices, cuda:0 and cpu"


@pytest.fixture
def installed():
    """The shim installed process-wide for one test, as the pack installs it."""
    shim.FIX.install()
    yield shim.FIX
    shim.FIX.uninstall()


@pytest.fixture
def fake_cuda_indexing(monkeypatch):
    """Lets a FakeTensor ``cuda`` run the few Tensor methods whose Python bindings open a CUDA device guard, which a
    CPU-only torch lacks ("PyTorch is not linked with support for cuda devices"): they run with the tensors' fake
    device set to cpu and the result's set back. Device checks of every other op (SDPA included) are untouched."""
    from torch._subclasses.fake_tensor import FakeTensor

    def on_host_guard(method):
        def run(self, *args):
            fakes = [t for t in (self, *args, *(args[0] if args and isinstance(args[0], tuple) else ()))
                     if isinstance(t, FakeTensor)]
            devices = [t.fake_device for t in fakes]
            for tensor in fakes:
                tensor.fake_device = torch.device("cpu")
            try:
                out = method(self, *args)
            finally:
                for tensor, device in zip(fakes, devices, strict=True):
                    tensor.fake_device = device
            if isinstance(out, FakeTensor):
                out.fake_device = devices[0]
            return out
        return run

    for name in ("__getitem__", "__setitem__", "copy_", "contiguous"):
        monkeypatch.setattr(FakeTensor, name, on_host_guard(getattr(torch.Tensor, name)), raising=False)


def all_tensors(inputs):
    for value in inputs.values():
        if isinstance(value, torch.Tensor):
            yield value
        yield from nested_tensors(value)


def counting_moves(monkeypatch) -> list:
    """The inputs the shim moves: top-level containers only (``move_nested`` also calls itself for their items)."""
    calls = []

    def counted(value, device):
        if not isinstance(value, torch.Tensor):
            calls.append(value)
        return move_nested(value, device)

    monkeypatch.setattr(static_cache_kernels, "move_nested", counted)
    return calls


def generate_on_fake_cuda(model):
    """``generate()`` with host-side inputs and the model on FakeTensor cuda; returns (output ids, the devices of
    every tensor that reached ``forward``)."""
    cls = type(model)
    reached = set()
    with fake_cuda_mode() as mode:
        pass
    static_cache_kernels.to_fake_cuda(model, mode)

    @functools.wraps(cls.prepare_inputs_for_generation)
    def prepare_inputs_for_generation(*args, **kwargs):
        with mode:
            return cls.prepare_inputs_for_generation(model, *args, **kwargs)

    @functools.wraps(cls.forward)
    def forward(*args, **kwargs):
        reached.update(str(tensor.device) for tensor in all_tensors(kwargs))
        with mode:
            out = cls.forward(model, *args, **kwargs)
        out.logits = torch.zeros(out.logits.shape)
        return out

    model.prepare_inputs_for_generation, model.forward = prepare_inputs_for_generation, forward
    return model.generate(input_ids=PROMPT, attention_mask=PADDED, **GENERATE), reached


def reported_on(model, device: torch.device):
    """``model`` reporting ``device`` as its device (its weights stay where they are)."""
    model.__class__ = type(f"{type(model).__name__}On", (type(model),), {"device": property(lambda self: device)})
    return model


def tp_model(plan, kv_heads=2):
    model = tiny_qwen3() if kv_heads == 2 else transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8))
    model._tp_size = 2
    model.tp_plan = plan
    return model


COLWISE_KV = {"model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.v_proj": "colwise"}
GATHERED_KV = {"model.layers.*.self_attn.k_proj": "colwise_gather_output",
               "model.layers.*.self_attn.v_proj": "colwise_gather_output"}
MLP_ONLY = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise"}


# -- the helper and the registry, on any transformers ----------------------------------------------------------

def test_move_nested_moves_containers_and_leaves_other_objects():
    Pair = collections.namedtuple("Pair", "first second")
    cache = object()
    host = {"masks": {"full_attention": torch.ones(2), "sliding_attention": None},
            "pixels": [torch.ones(1), (torch.ones(1), 3)], "pair": Pair(torch.ones(1), cache),
            "output": transformers.modeling_outputs.BaseModelOutput(last_hidden_state=torch.ones(1))}
    meta = torch.device("meta")
    moved = move_nested(host, meta)
    assert {str(t.device) for t in nested_tensors(moved)} == {"meta"}
    assert moved["pair"].second is cache and isinstance(moved["pair"], Pair)
    assert isinstance(moved["output"], transformers.modeling_outputs.BaseModelOutput)
    assert moved["output"].last_hidden_state.device == meta  # ModelOutput keeps attribute and item in step
    assert moved["masks"]["sliding_attention"] is None and moved["pixels"][1][1] == 3
    assert {str(t.device) for t in nested_tensors(host)} == {"cpu"}, "the caller's containers were modified"
    assert move_nested(moved, meta) is moved, "nothing to move must return the very same object"


def test_a_probe_failing_on_drifted_code_reads_failed_in_one_line():
    """Found on a mutant (tests/hotfix_testing/mutated_cores.py, "static cache: masks built on the model device"): a
    probe stopped by a dispatcher error, whose message lists every backend over dozens of lines, must still give a
    status reason of one line (the status table, the log, the doctor print it)."""
    def probe(mixin):
        raise NotImplementedError("Could not run 'aten::empty_strided' with arguments from the 'CUDA' backend.\n\n"
                                  "CPU: registered at RegisterCPU_2.cpp:2359 [kernel]\nMeta: registered at ...")

    found = shim._probed(probe, object())
    assert found.state is State.FAILED
    assert found.reason == ("target drifted, left off: probe failed (NotImplementedError: Could not run "
                            "'aten::empty_strided' with arguments from the 'CUDA' backend.)")


def test_registry_lists_the_fix_with_its_off_switch(monkeypatch):
    assert shim.FIX in pack_registry.fixes_for("process") and pack_registry.all_fixes()[shim.FIX_ID] is shim.FIX
    assert shim.FIX_ID in [row[0] for row in status_rows()]
    monkeypatch.setenv(pack_registry.DISABLE_ENV, shim.FIX_ID)
    assert pack_registry.status(shim.FIX).state is State.DISABLED


def test_install_is_lazy_and_reversible():
    """Installing at pack load must not import transformers; the wrappers appear when transformers' generation code
    is imported, and uninstall puts the original methods back. A fresh interpreter, so nothing is imported yet."""
    code = (
        "import sys, torch\n"
        "from minimax_hotfix.patches import transformers_static_cache as shim\n"
        "from minimax_hotfix.kernels import transformers_static_cache as static_cache_kernels\n"
        "from minimax_hotfix.contract import State\n"
        "from minimax_hotfix import registry as pack_registry\n"
        "assert shim.FIX in pack_registry.fixes_for('process')\n"
        "assert pack_registry.status(shim.FIX).state is State.FIXED_UPSTREAM, 'no guard at pack load on a fixed transformers'\n"
        "assert not any(m == 'transformers' or m.startswith('transformers.') for m in sys.modules), 'imported'\n"
        "shim.FIX.install(); shim.FIX.install()\n"
        "assert not any(m == 'transformers' or m.startswith('transformers.') for m in sys.modules), 'imported'\n"
        "from transformers.generation.utils import GenerationMixin as G\n"
        "wrapped = G.__dict__[static_cache_kernels.PREPARE_INPUTS]\n"
        "assert getattr(wrapped, static_cache_kernels.WRAPPED).__qualname__ == 'GenerationMixin.prepare_inputs_for_generation'\n"
        "assert hasattr(G.__dict__[static_cache_kernels.INIT_SHAPE], static_cache_kernels.WRAPPED)\n"
        "assert shim.FIX._verdict is None, 'probed before first use'\n"
        "shim.FIX.uninstall()\n"
        "assert not hasattr(G.__dict__[static_cache_kernels.PREPARE_INPUTS], static_cache_kernels.WRAPPED) and shim.FIX._import_hook is None\n"
        "assert G.__dict__[static_cache_kernels.PREPARE_INPUTS] is getattr(wrapped, static_cache_kernels.WRAPPED)\n"
        "shim.FIX.install(); assert hasattr(G.__dict__[static_cache_kernels.PREPARE_INPUTS], static_cache_kernels.WRAPPED), 'already imported'\n"
        "shim.FIX.uninstall(); assert not hasattr(G.__dict__[static_cache_kernels.INIT_SHAPE], static_cache_kernels.WRAPPED)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/", timeout=300,
                   env={**os.environ, "PYTHONPATH": child_pythonpath(os.environ.get("PYTHONPATH"))})


# -- latest transformers: fixed upstream, the shim does nothing -------------------------------------------------

def test_latest_version_gets_no_guard_at_pack_load(monkeypatch):
    monkeypatch.setattr(shim.FIX, "_verdict", None)
    assert pack_registry.status(shim.FIX).state is State.FIXED_UPSTREAM  # so the registry installs nothing
    assert shim.FIX._verdict is None  # decided without importing or probing transformers


def test_release_numbers_bound_the_guard():
    assert shim._release("5.19.0") == (5, 19, 0) and shim._release("5.20.2.dev0") == (5, 20, 2)
    assert shim.FIRST_AFFECTED <= shim._release("5.20.1") < shim.FIRST_FIXED <= shim._release("5.24.0")
    assert shim._release("4.57.6") < shim.FIRST_AFFECTED


def test_latest_probe_finds_both_bugs_fixed_upstream():
    found = shim.FIX.verdict()
    assert (found.masks.state, found.tp_heads.state) == (State.FIXED_UPSTREAM, State.FIXED_UPSTREAM), found
    assert shim.FIX.detect().state is State.FIXED_UPSTREAM


def wrapped_methods():
    mixin = transformers.GenerationMixin
    return {name for name in static_cache_kernels.WRAPPERS
            if hasattr(mixin.__dict__[name], static_cache_kernels.WRAPPED)}


@pytest.mark.parametrize("name", TINY_MODELS)
def test_latest_generate_on_fake_cuda_is_left_alone(name, fake_cuda_indexing, monkeypatch):
    """First use on a fixed transformers: the guard probes, touches nothing, and removes itself."""
    monkeypatch.setattr(shim.FIX, "_verdict", None)
    calls = counting_moves(monkeypatch)
    shim.FIX.install()
    assert wrapped_methods() == set(static_cache_kernels.WRAPPERS)
    try:
        out, reached = generate_on_fake_cuda(TINY_MODELS[name]())
        assert out.shape == (2, 9) and reached == {"cuda:0"}
        assert calls == [], "the shim touched inputs on a transformers that is fixed upstream"
        assert wrapped_methods() == set(), "the pass-through guard stayed after the probe found nothing to repair"
        shim.FIX.install()
        assert wrapped_methods() == set(), "installed again although nothing needs repair"
    finally:
        shim.FIX.uninstall()


@pytest.mark.parametrize("plan, heads", [(COLWISE_KV, 1), (GATHERED_KV, 2), (MLP_ONLY, 2)])
def test_latest_tp_heads_unchanged_by_the_shim(plan, heads, monkeypatch):
    monkeypatch.setattr(shim.FIX, "_verdict", None)
    shim.FIX.install()
    try:
        model = tp_model(plan)
        original = static_cache_kernels.unwrapped(transformers.GenerationMixin, static_cache_kernels.INIT_SHAPE)
        assert model._get_static_cache_init_shape() == original(model) == (heads, 8)
    finally:
        shim.FIX.uninstall()


def test_latest_sharding_rule_matches_upstream():
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    plans = [{}, COLWISE_KV, GATHERED_KV, MLP_ONLY, {"model.layers.*.self_attn.qkv_proj": "colwise"},
             {"model.layers.*.self_attn.query_key_value": "colwise"}, {"model.layers.*.self_attn.q_proj": "colwise"},
             {"model.layers.*.self_attn.k_proj": "packed_colwise"}, {"model.layers.*.mlp.experts": "grouped_gemm"}]
    for plan in plans:
        assert static_cache_kernels.shards_kv_heads(plan) == (get_kv_heads_per_rank(plan, 4, 2) == 2), plan


@pytest.mark.parametrize("version", ["latest", AFFECTED])
def test_seed_003_on_the_simulated_accelerator(version):
    """The seed end to end on a device that holds data: tiny Gemma 3 and Qwen3 on ``npu:0``, inputs in CPU RAM,
    generate(cache_implementation="static") (tests/hotfix_testing/generate_on_simulated_device.py, a subprocess per version).
    5.19: red without the pack (the device's mixed-device error), green with it, ids equal to the all-CPU run.
    Latest: fixed upstream, both complete with equal ids and the pack installs nothing."""
    env = dict(os.environ)
    env.pop(pack_registry.DISABLE_ENV, None)
    if version == AFFECTED:
        overlay = ROOT / ".venv" / "extra" / f"transformers-{AFFECTED}"
        if not (overlay / "transformers").is_dir():
            pytest.skip(f"{overlay.relative_to(ROOT)} is absent: `bash tools/venv.sh true` installs it")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(overlay), os.environ.get("PYTHONPATH")]))
    env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH"))
    result = subprocess.run([sys.executable, "-m", "hotfix_testing.generate_on_simulated_device"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    for name, run in report["models"].items():
        assert run["pack"].get("ids") == run["cpu"], (name, run["pack"])
        if version == AFFECTED:
            assert report["fix_state"] == "NEEDED" and report["probe"]["masks"] == "NEEDED"
            assert run["stock"].get("error", "").startswith(
                "Expected all tensors to be on the same device, but found at least two devices, npu:0 and cpu!"), run
        else:
            assert report["fix_state"] == "FIXED_UPSTREAM" and run["stock"] == run["pack"], run


# -- transformers 5.19.0: both bugs, red without the shim, green with it ----------------------------------------

@affected_only
def test_affected_probe_finds_both_bugs():
    found = shim.FIX.verdict()
    assert (found.masks.state, found.tp_heads.state) == (State.NEEDED, State.NEEDED), found
    assert shim.FIX.detect().state is State.NEEDED
    assert all(check.passed for check in self_test(shim.FIX))


@affected_only
def test_affected_version_gets_the_guard_at_pack_load(monkeypatch):
    monkeypatch.setattr(shim.FIX, "_verdict", None)
    found = pack_registry.status(shim.FIX)  # NEEDED is what makes the registry install it at pack load
    assert found.state is State.NEEDED and found.provisional


@affected_only
@pytest.mark.parametrize("name", TINY_MODELS)
def test_affected_generate_on_fake_cuda_red_without_shim(name, fake_cuda_indexing):
    shim.FIX.uninstall()
    with pytest.raises(RuntimeError, match=MISMATCH):
        generate_on_fake_cuda(TINY_MODELS[name]())


@affected_only
@pytest.mark.parametrize("name", TINY_MODELS)
def test_affected_generate_on_fake_cuda_green_with_shim(name, installed, fake_cuda_indexing):
    out, reached = generate_on_fake_cuda(TINY_MODELS[name]())
    assert out.shape == (2, 9) and reached == {"cuda:0"}


@affected_only
@pytest.mark.parametrize("name", TINY_MODELS)
def test_affected_cpu_token_ids_equal_the_on_device_run(name, installed, monkeypatch):
    """Real data: the model reports ``cpu:0``, so host-side (``cpu``) inputs count as off-device and every step goes
    through transformers' move and the shim's; the ids must equal a plain run with the inputs on the model device."""
    shim.FIX.uninstall()
    reference = TINY_MODELS[name]().generate(input_ids=PROMPT, attention_mask=PADDED, **GENERATE)
    shim.FIX.install()
    calls = counting_moves(monkeypatch)
    model = reported_on(TINY_MODELS[name](), torch.device("cpu", 0))
    out = model.generate(input_ids=PROMPT, attention_mask=PADDED, **GENERATE)
    assert torch.equal(out, reference), (out, reference)
    assert len(calls) == GENERATE["max_new_tokens"], "the shim did not move the nested masks at every step"


@affected_only
def test_affected_inputs_already_on_the_model_device_are_left_alone(installed, monkeypatch):
    """Upstream's condition (5.20.2+): nothing is moved when the main input is on the model device already. Red
    control: with the main input off the device (the model reports ``cpu:0``) the same masks are moved."""
    calls = counting_moves(monkeypatch)
    tiny_qwen3().generate(input_ids=PROMPT, attention_mask=PADDED, **GENERATE)
    assert calls == [], "the shim moved inputs that were on the model device already"
    reported_on(tiny_qwen3(), torch.device("cpu", 0)).generate(input_ids=PROMPT, attention_mask=PADDED, **GENERATE)
    assert len(calls) == GENERATE["max_new_tokens"]


SAMPLED = dict(GENERATE, do_sample=True, max_new_tokens=8)


def seeded_ids(model) -> list[int]:
    """A user's seeded sampling run: ``torch.manual_seed(7); model.generate(..., do_sample=True)``."""
    torch.manual_seed(7)
    return model.generate(input_ids=PROMPT[:1], attention_mask=PADDED[:1], **SAMPLED)[0, PROMPT.shape[1]:].tolist()


def first_use_and_later_ids(monkeypatch) -> tuple[list[int], list[int], list[int]]:
    """Seeded ids of the first generate() after start-up (it runs the probe), of the second, and without the pack."""
    model = tiny_qwen3()
    monkeypatch.setattr(shim.FIX, "_verdict", None)
    shim.FIX.install()
    try:
        first, second = seeded_ids(model), seeded_ids(model)
        assert shim.FIX._verdict is not None, "the first generate() did not probe"
    finally:
        shim.FIX.uninstall()
    print(f"first call after start-up: {first}\nsecond call:               {second}")
    return first, second, seeded_ids(model)


@affected_only
def test_affected_seeded_generate_is_the_same_on_first_use(monkeypatch):
    first, second, without_pack = first_use_and_later_ids(monkeypatch)
    assert first == second == without_pack


@affected_only
def test_affected_seeded_generate_red_with_a_probe_on_the_global_generator(monkeypatch):
    """Red control: the probe model built as before, with weights drawn from the global generator on the CPU."""
    config = static_cache_kernels.probe_model().config
    monkeypatch.setattr(static_cache_kernels, "probe_model", lambda: transformers.Qwen3ForCausalLM(config).eval())
    first, second, without_pack = first_use_and_later_ids(monkeypatch)
    assert first != second == without_pack


@affected_only
def test_affected_verdict_is_logged_once(installed, monkeypatch, caplog):
    monkeypatch.setattr(shim.FIX, "_verdict", None)
    caplog.set_level("INFO", logger="minimax_hotfix")
    assert pack_registry.status(shim.FIX).provisional  # as at pack load
    tiny_qwen3().generate(input_ids=PROMPT, attention_mask=PADDED, **GENERATE)
    status_rows()  # the Status node asks again
    pack_registry.status(shim.FIX)
    verdicts = [record.getMessage() for record in caplog.records if "nested masks:" in record.getMessage()]
    assert len(verdicts) == 1, verdicts


@affected_only
@pytest.mark.parametrize("plan, buggy, fixed", [(COLWISE_KV, 1, 1), (GATHERED_KV, 1, 2), (MLP_ONLY, 1, 2)])
def test_affected_tp_heads_divided_only_for_colwise_kv(plan, buggy, fixed):
    """No distributed init: ``_tp_size=2`` and a plan on a tiny Qwen3 with 2 KV heads. Colwise k/v is the control
    that divides both ways; gathered and MLP-only plans divide without the shim (red) and not with it (green)."""
    assert tp_model(plan)._get_static_cache_init_shape() == (buggy, 8)
    shim.FIX.install()
    try:
        assert tp_model(plan)._get_static_cache_init_shape() == (fixed, 8)
    finally:
        shim.FIX.uninstall()


@affected_only
def test_affected_tp_early_initialized_cache_has_every_kv_head(installed):
    """Through ``_prepare_static_cache`` with ``prefill_chunk_size``: the cache that generate() initializes early
    must hold the 2 KV heads each rank computes when k/v are gathered (1 head gives the broadcast error)."""
    def heads(model):
        cache = model._prepare_static_cache("static", batch_size=1, max_cache_len=16, prefill_chunk_size=4,
                                            model_kwargs={})
        return cache.layers[0].keys.shape[1]

    shim.FIX.uninstall()
    assert heads(tp_model(GATHERED_KV)) == 1
    assert tp_model(GATHERED_KV, kv_heads=1)._get_static_cache_init_shape() is None  # 1 head: "can't split"
    shim.FIX.install()
    assert heads(tp_model(GATHERED_KV)) == 2
    assert tp_model(GATHERED_KV, kv_heads=1)._get_static_cache_init_shape() == (1, 8)


@affected_only
def test_affected_off_switch_restores_the_original_behaviour(installed, fake_cuda_indexing, monkeypatch):
    monkeypatch.setenv(pack_registry.DISABLE_ENV, shim.FIX_ID)
    with pytest.raises(RuntimeError, match=MISMATCH):
        generate_on_fake_cuda(tiny_qwen3())
    assert tp_model(MLP_ONLY)._get_static_cache_init_shape() == (1, 8)
