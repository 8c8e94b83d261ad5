"""ck_rope_device: a stray CPU scale/table no longer sends comfy-kitchen's rope calls to the failing eager backend.

Routing is kitchen's own (``BackendRegistry.get_capable_backend`` with the eager backend's and the real CUDA backend's
constraints, see ``real_kitchen_routing`` in diagnostics/kitchen.py) on FakeTensor "cuda" q/k; values are compared on the
CPU, the only device here that holds data.
"""

import functools
import logging
import sys
import threading

import comfy_kitchen
import pytest
import torch

from minimax_hotfix import registry as pack_registry
from minimax_hotfix.contract import State
from minimax_hotfix.diagnostics import self_test
from minimax_hotfix.diagnostics.kitchen import real_kitchen_routing, rope_inputs
from minimax_hotfix.kernels.ck_rope_device import (
    device_aligned,
    is_device_mismatch,
    operand_positions,
    rope_function_names,
    unaligned,
)
from minimax_hotfix.kernels.fake_cuda import fake_cuda_mode, on_fake_cuda
from minimax_hotfix.patches import ck_rope_device

FIX = ck_rope_device.FIX
ROPE_NAMES = rope_function_names(comfy_kitchen)
# FakeTensor pitfalls (docs: library-internals §1d): kitchen's in-place overlap check reads data_ptr() (0 for every
# fake tensor) and the interleaved eager rope indexes in Python (needs a CUDA device guard), so in eager these raise
# before reaching the device check. Routing to eager is the red control for them; the others give the device error.
REACHES_DEVICE_CHECK_IN_EAGER = {"rms_rope", "rms_rope1", "rms_rope_split_half", "rms_rope_split_half1",
                                 "apply_rope_split_half", "apply_rope_split_half1", "apply_rope_split_half1_"}

pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")


def call_inputs(name, place):
    """Positional activations and keyword operands for the kitchen function ``name``; activations through ``place``,
    operands on the CPU, shaped for the fused CUDA kernel (bf16, head_dim 64, full-width rotation table)."""
    generator = torch.Generator().manual_seed(0)
    sample = lambda *shape: torch.randn(*shape, generator=generator).to(torch.bfloat16)  # noqa: E731
    q, k, table = sample(1, 8, 2, 64), sample(1, 8, 2, 64), sample(1, 8, 1, 32, 2, 2)
    _, operands = operand_positions(getattr(comfy_kitchen, name))
    first_operand = operands[0][0]
    activations = [place(q), place(k)][:first_operand]
    values = {"freqs_cis": table, "q_scale": torch.ones(64, dtype=torch.bfloat16), "k_scale": None,
              "scale": torch.ones(64, dtype=torch.bfloat16)}
    return activations, {operand: values[operand] for _, operand in operands}


@pytest.fixture
def restore_kitchen():
    """The fix not installed (so nothing logged yet, whatever ran before) and kitchen's functions put back after."""
    FIX.uninstall()
    originals = {name: getattr(comfy_kitchen, name) for name in ROPE_NAMES}
    yield
    FIX.uninstall()
    for name, original in originals.items():
        setattr(comfy_kitchen, name, original)


@pytest.mark.parametrize("name", ROPE_NAMES)
def test_stray_cpu_operand_goes_to_eager_and_fails_aligned_goes_to_cuda(name, caplog):
    caplog.set_level(logging.DEBUG, logger="comfy_kitchen.dispatch")
    kernel = getattr(comfy_kitchen, name)
    with fake_cuda_mode() as mode, real_kitchen_routing() as chosen:
        place = lambda t: on_fake_cuda(mode, t)  # noqa: E731
        activations, cpu_operands = call_inputs(name, place)
        stray = "freqs_cis" if name.startswith("apply") else next(n for n in ("q_scale", "scale") if n in cpu_operands)
        on_device = {n: (place(v) if v is not None else None) for n, v in cpu_operands.items()}
        kernel(*activations, **on_device)
        reference_route = chosen[-1]
        left_behind = {**on_device, stray: cpu_operands[stray]}
        with pytest.raises(Exception) as red:
            kernel(*activations, **left_behind)
        red_route = chosen[-1]
        caplog.clear()
        device_aligned(kernel)(*activations, **left_behind)
    assert (reference_route, red_route, chosen[-1]) == ("cuda", "eager", "cuda")
    assert f"Backend cuda selected for {name}" in caplog.text
    if name in REACHES_DEVICE_CHECK_IN_EAGER:
        assert is_device_mismatch(red.value), red.value
        assert "Expected all tensors to be on the same device" in str(red.value)


def test_the_kernel_receives_the_callers_activations_and_the_operand_on_their_device():
    seen = []
    kernel = comfy_kitchen.rms_rope_split_half

    @functools.wraps(kernel)
    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return kernel(*args, **kwargs)

    with fake_cuda_mode() as mode, real_kitchen_routing():
        q, k, table, scale = rope_inputs(lambda t: on_fake_cuda(mode, t))
        device_aligned(spy)(q, k, table, scale, epsilon=1e-5, rot_dim=32)
    (args, kwargs), = seen
    assert args[0] is q and args[1] is k and args[2] is table
    assert args[3].device == q.device and args[3].dtype == scale.dtype and args[3].shape == scale.shape
    assert kwargs == {"epsilon": 1e-5, "rot_dim": 32}


@pytest.mark.parametrize("name", ROPE_NAMES)
def test_devices_agreeing_the_very_same_call_is_made_and_values_are_unchanged(name):
    kernel = getattr(comfy_kitchen, name)
    seen = []

    @functools.wraps(kernel)
    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return kernel(*args, **kwargs)

    activations, operands = call_inputs(name, lambda t: t.float())
    operands = {n: (v.float() if v is not None else None) for n, v in operands.items()}
    expected = kernel(*[a.clone() for a in activations], **operands)
    got = device_aligned(spy)(*activations, **operands)
    (args, kwargs), = seen
    assert all(a is b for a, b in zip(args, activations, strict=True)) and all(kwargs[n] is v for n, v in operands.items())
    expected, got = (expected, got) if isinstance(got, tuple) else ((expected,), (got,))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_install_wraps_every_rope_function_once_and_uninstall_restores_them(restore_kitchen, caplog):
    originals = {name: getattr(comfy_kitchen, name) for name in ROPE_NAMES}
    FIX.install()
    wrapped = {name: getattr(comfy_kitchen, name) for name in ROPE_NAMES}
    FIX.install()
    assert all(getattr(comfy_kitchen, name) is wrapped[name] for name in ROPE_NAMES)
    assert all(wrapped[name] is not originals[name] and wrapped[name].__wrapped__ is originals[name]
               for name in ROPE_NAMES)
    # what the self-tests' red controls call: kitchen's own function, past this wrapper but not past anyone else's
    assert all(unaligned(wrapped[name]) is originals[name] and unaligned(originals[name]) is originals[name]
               for name in ROPE_NAMES)
    foreign = functools.wraps(wrapped[ROPE_NAMES[0]])(lambda *args, **kwargs: None)
    assert unaligned(foreign) is foreign

    caplog.set_level(logging.INFO, logger="minimax_hotfix")
    with fake_cuda_mode() as mode, real_kitchen_routing() as chosen:
        q, k, table, scale = rope_inputs(lambda t: on_fake_cuda(mode, t))
        for _ in range(2):
            comfy_kitchen.rms_rope_split_half_(q, k, table, scale, rot_dim=32)  # as comfy.quant_ops.ck.<name>
    assert chosen == ["cuda", "cuda"]
    assert caplog.text.count("moved q_scale from cpu to cuda:0 for comfy_kitchen.rms_rope_split_half_") == 1

    FIX.uninstall()
    assert all(getattr(comfy_kitchen, name) is originals[name] for name in ROPE_NAMES)


class NameThatWaits(str):
    """A function name whose hashing, the first step of looking a move up among those logged, waits until two threads
    hash it (or 0.5 s passed, when one waits for the other elsewhere): two first moves then look at once."""

    def __new__(cls, name, both_looking: threading.Barrier):
        named = super().__new__(cls, name)
        named.both_looking = both_looking
        return named

    def __hash__(self):
        try:
            self.both_looking.wait(0.5)
        except threading.BrokenBarrierError:
            pass
        return str.__hash__(self)


def test_two_threads_making_the_same_first_move_log_it_once(restore_kitchen, caplog):
    name = "rms_rope_split_half"
    kernel = getattr(comfy_kitchen, name)

    @functools.wraps(kernel)
    def does_nothing(*args, **kwargs):
        return None

    does_nothing.__name__ = NameThatWaits(name, threading.Barrier(2))
    setattr(comfy_kitchen, name, does_nothing)
    FIX.install()
    caplog.set_level(logging.INFO, logger="minimax_hotfix")
    q, k, table, scale = rope_inputs(lambda t: t.to("meta"))  # the scale left on the CPU
    threads = [threading.Thread(target=getattr(comfy_kitchen, name), args=(q, k, table, scale), kwargs={"rot_dim": 32})
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert caplog.text.count(f"moved q_scale from cpu to meta for comfy_kitchen.{name} ") == 1


def test_off_switch_keeps_kitchen_untouched(restore_kitchen, monkeypatch):
    originals = {name: getattr(comfy_kitchen, name) for name in ROPE_NAMES}
    monkeypatch.setenv(pack_registry.DISABLE_ENV, FIX.id)
    assert pack_registry.status(FIX).state == State.DISABLED
    try:
        assert FIX.id not in pack_registry.install_process_fixes()
        assert all(getattr(comfy_kitchen, name) is originals[name] for name in ROPE_NAMES)
    finally:
        pack_registry.uninstall_process_fixes()


def test_detects_the_bug_in_this_kitchen(fresh_detection):
    assert pack_registry.status(FIX).state == State.NEEDED


def test_detects_a_kitchen_whose_eager_rope_aligns_itself(fresh_detection, monkeypatch):
    from comfy_kitchen.backends import eager

    unaligned = eager.rms_rope1
    monkeypatch.setattr(eager, "rms_rope1", lambda x, freqs_cis, scale, epsilon=1e-6:
                        unaligned(x, freqs_cis.to(x.device), scale.to(x.device), epsilon))
    assert pack_registry.status(FIX).state == State.FIXED_UPSTREAM


def test_fails_and_stays_off_when_a_rope_signature_drifted(fresh_detection, monkeypatch):
    monkeypatch.setattr(comfy_kitchen, "rms_rope1", lambda x, freqs, weight, eps=1e-6: None)
    status = pack_registry.status(FIX)
    assert status.state == State.FAILED and "rms_rope1" in status.reason


def test_not_applicable_without_kitchen(fresh_detection, monkeypatch):
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)
    assert pack_registry.status(FIX).state == State.NOT_APPLICABLE


def test_self_test_red_then_green():
    checks = list(self_test(FIX))
    assert checks[0].name.startswith("red:") and all(check.passed for check in checks), checks
