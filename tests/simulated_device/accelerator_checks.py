"""Checks of the simulated accelerator itself, each with its red control: its values are the CPU's, it raises the
accelerator's error on mixed devices, it counts host-to-device copies, it can lack ``torch._int_mm``, a parameter's
``.data`` moves between host and device; and of the stand-in comfy-aimdo beside it (tests/simulated_device/dynamic_vram):
weights resident within a budget, other models' weights evicted. Installing the
device patches torch for the whole process (``torch.tensor``, ``torch.Generator``, ``torch._int_mm``, the ``npu``
backend), so these run in a pytest process of their own (tests/test_simulated_device.py), never beside other tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from simulated_device import simulated_accelerator as device  # noqa: E402  (tests/ on the path: pyproject.toml)

device.install(clear_cuda_version=False)  # the torch build keeps its identity (the checks do not need it cleared)
NPU0, NPU1 = torch.device("npu", 0), torch.device("npu", 1)


@pytest.fixture
def on_device():
    """The dispatch mode in this thread, fresh counters, ``_int_mm`` present; restored afterwards."""
    device.reset_counters()
    with device.SimulatedDeviceMode():
        yield
    device.set_int_mm(True)
    device.reset_counters()


def small_model(generator: torch.Generator) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 8))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


def test_values_are_the_cpus_and_a_wrong_dispatch_shows(on_device, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    model, x = small_model(generator), torch.randn(4, 16, generator=generator)
    expected = model(x)
    with torch.inference_mode():
        model.to(NPU0)
        out = model(x.to(NPU0))
    assert out.device == NPU0 and isinstance(out, device.DeviceTensor)
    assert all(parameter.device == NPU0 for parameter in model.parameters())
    assert torch.equal(out.cpu(), expected)
    # red control: a dispatch that computes on slightly different values is seen by the same comparison
    monkeypatch.setattr(device, "unwrap", lambda value: value.elem * (1 + 2 ** -10) if isinstance(
        value, device.DeviceTensor) else value)
    with torch.inference_mode():
        wrong = model(x.to(NPU0))
    monkeypatch.undo()
    assert not torch.equal(wrong.cpu(), expected)


def test_mixed_devices_raise_the_accelerator_error(on_device):
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    with pytest.raises(RuntimeError, match=r"^Expected all tensors to be on the same device, but found at least two "
                                           r"devices, npu:0 and cpu!"):
        a.to(NPU0) + b
    with pytest.raises(RuntimeError, match=r"found at least two devices, npu:1 and npu:0!"):
        a.to(NPU1) @ b.to(NPU0)
    # allowed as on CUDA: a 0-dim CPU tensor, CPU indices, copies both ways
    assert torch.equal((a.to(NPU0) * torch.tensor(2.0)).cpu(), a * 2)
    index = torch.tensor([2, 0])
    assert torch.equal(a.to(NPU0)[index].cpu(), a[index])
    target = torch.empty(3, 3, device=NPU0)
    target.copy_(b, non_blocking=True)
    assert torch.equal(target.cpu(), b) and torch.equal(target.to(NPU1).cpu(), b)


def test_factories_generators_and_inference_mode(on_device):
    assert torch.zeros(2, 3, device="npu").device == NPU0  # an unindexed device is the current one
    assert torch.ones(2, device=NPU1).device == NPU1
    made = torch.tensor([1.5, 2.5], device=NPU0)
    assert made.device == NPU0 and made.cpu().tolist() == [1.5, 2.5]
    on_npu = torch.randn(5, generator=torch.Generator(device="npu").manual_seed(3), device=NPU0)
    on_cpu = torch.randn(5, generator=torch.Generator().manual_seed(3))
    assert on_npu.device == NPU0 and torch.equal(on_npu.cpu(), on_cpu)
    with torch.inference_mode():
        plain = torch.randn(4, 4)
        assert type(plain.view(16)) is torch.Tensor and type(plain.t()) is torch.Tensor
        half = plain.to(NPU0).to(torch.float16)
        assert half.device == NPU0 and half.dtype == torch.float16
        assert torch.equal(half.cpu(), plain.to(torch.float16))
    moved = plain.to(NPU0)
    assert moved.to(NPU0) is moved  # no change: the same tensor, as on CUDA
    assert moved.tolist() == plain.tolist() and moved[0, 0].item() == plain[0, 0].item()


def test_host_to_device_counters(on_device):
    host = torch.randn(1000)
    on_npu = host.to(NPU0)
    target = torch.empty(1000, device=NPU0)
    target.copy_(host)
    on_npu.to(NPU1)  # device to device: not host-to-device
    on_npu.cpu()
    torch.zeros(2, 3, dtype=torch.float16).to(NPU0)
    assert device.host_to_device() == {"_to_copy": [2, 4012], "copy_": [1, 4000]}
    assert device.host_to_device_by_shape() == {"1000 float32": [2, 8000], "2x3 float16": [1, 12]}
    device.reset_counters()
    assert device.host_to_device() == {} and device.host_to_device_by_shape() == {}


def test_memory_accounting_follows_live_tensors(on_device):
    device.set_total_mb(64)
    try:
        before_free, total = torch.npu.mem_get_info(NPU0)
        assert total == 64 * 1024 * 1024
        block = torch.empty(1024, 1024, device=NPU0)  # 4 MiB
        view = block[:10]
        free, _ = torch.npu.mem_get_info(NPU0)
        assert before_free - free == 4 * 1024 * 1024  # a view shares its storage: counted once
        assert torch.npu.memory_stats(NPU0)["active_bytes.all.current"] == device.allocated_bytes(0)
        del block, view
        assert torch.npu.mem_get_info(NPU0)[0] == before_free
    finally:
        device.set_total_mb(float(os.environ.get(device.TOTAL_MB_ENV, "2048")))


@torch.library.custom_op("minimax_hotfix_tests::int8_gemm", mutates_args=())
def int8_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch._int_mm(a, b)  # called from Python on the unwrapped tensors, as comfy-kitchen's eager kernel


@int8_gemm.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.int32)


def test_no_int_mm_mode_raises_the_mps_error_where_device_work_is_unwrapped(on_device):
    a = torch.randint(-8, 8, (32, 32), dtype=torch.int8)
    b = torch.randint(-8, 8, (32, 32), dtype=torch.int8)
    expected = torch._int_mm(a, b)
    assert torch.equal(int8_gemm(a.to(NPU0), b.to(NPU0)).cpu(), expected)  # green: the device has it
    device.set_int_mm(False)
    for call in (lambda: torch._int_mm(a.to(NPU0), b.to(NPU0)), lambda: int8_gemm(a.to(NPU0), b.to(NPU0))):
        with pytest.raises(NotImplementedError, match=r"aten::_int_mm' is not currently implemented for the MPS"):
            call()
    assert torch.equal(torch._int_mm(a, b), expected)  # the host keeps it


def test_quantized_tensor_unpacks_itself_first(on_device, monkeypatch):
    quant_ops = pytest.importorskip("comfy_kitchen.tensor")
    generator = torch.Generator().manual_seed(5)
    weight, x = torch.randn(64, 256, generator=generator), torch.randn(4, 256, generator=generator)
    quantized = quant_ops.QuantizedTensor.from_float(weight, "TensorWiseINT8Layout")
    expected = torch.nn.functional.linear(x, quantized)
    on_npu = quantized.to(NPU0)
    assert type(on_npu) is type(quantized) and on_npu._qdata.device == NPU0
    out = torch.nn.functional.linear(x.to(NPU0), on_npu)
    assert out.device == NPU0 and torch.equal(out.cpu(), expected)
    # red control: a device that claims every op for itself runs comfy-kitchen's kernel on the QuantizedTensor
    # with its device parts, and the kernel sees two devices
    original = device.run_op
    monkeypatch.setattr(device, "run_op", lambda func, types, args, kwargs: original(func, (), args, kwargs))
    with pytest.raises(RuntimeError, match=r"found at least two devices, npu:0 and cpu! .*int8_linear"):
        torch.nn.functional.linear(x.to(NPU0), on_npu)


def test_views_of_inference_tensors_outside_inference_mode(on_device):
    """A buffer moved under inference mode (a fix's hook during a node) and viewed later outside it."""
    with torch.inference_mode():
        buffer = torch.arange(4.0).to(NPU0)
    with torch.no_grad():
        view = buffer[None, :]
    assert view.device == NPU0 and torch.equal(view.cpu(), torch.arange(4.0)[None, :])


def test_data_setter_moves_a_parameter_between_host_and_device(on_device):
    """``parameter.data = parameter.data.to(device)`` (ComfyUI's dynamic VRAM loader, for modules that own weights
    beside children with weights) and back, as on a real device: the same object, still a parameter."""
    generator = torch.Generator().manual_seed(3)
    module = torch.nn.Linear(4, 4)
    weight, expected = module.weight, module(x := torch.randn(2, 4, generator=generator))
    weight.data = weight.data.to(NPU0)
    module.bias.data = module.bias.data.to(NPU0)
    assert module.weight is weight and weight.device == NPU0 and isinstance(weight, torch.nn.Parameter)
    assert torch.equal(module(x.to(NPU0)).cpu(), expected)
    weight.data = weight.data.cpu()
    assert module.weight is weight and weight.device.type == "cpu" and type(weight) is torch.nn.Parameter
    # red control: torch's own setter refuses a device tensor for a host parameter (the loader's crash)
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        device._tensor_data.__set__(module.weight, module.weight.data.to(NPU0))


DYNAMIC_VRAM = Path(__file__).with_name("dynamic_vram")


@pytest.fixture
def vbars(on_device, monkeypatch):
    """The stand-in comfy-aimdo's ``model_vbar`` (tests/simulated_device/dynamic_vram), budget restored after."""
    monkeypatch.syspath_prepend(str(DYNAMIC_VRAM))
    import comfy_aimdo.model_vbar as model_vbar

    assert model_vbar.__file__.startswith(str(DYNAMIC_VRAM))
    model_vbar.reset_counters()
    yield model_vbar
    model_vbar.set_budget(None)


def test_stand_in_vbar_keeps_weights_resident_within_its_budget(vbars):
    import comfy_aimdo.torch as aimdo_torch

    vbars.set_budget(3 / 1024)  # 3 KiB
    vbar = vbars.ModelVBAR(1 << 20, 0)
    first, second = vbar.alloc(2048), vbar.alloc(2048)
    signature = vbars.vbar_fault(first)
    assert signature is not None and vbar.loaded_size() == 2048
    slot = aimdo_torch.aimdo_to_tensor(first, NPU0)
    assert slot.device == NPU0 and slot.numel() == 2048 and device.allocated_bytes(0) >= 2048
    slot.fill_(7)
    vbars.vbar_unpin(first)
    again = vbars.vbar_fault(first)  # still resident: the same signature, the same values
    assert vbars.vbar_signature_compare(again, signature)
    assert torch.equal(aimdo_torch.aimdo_to_tensor(first, NPU0).cpu(), torch.full((2048,), 7, dtype=torch.uint8))
    assert vbars.vbar_fault(second) is None  # past the budget: out of VRAM, ComfyUI streams it
    assert vbars.stats()["counters"] == {"faulted_in": [1, 2048], "resident": [1, 2048], "out_of_vram": [1, 2048]}
    # red control: without a budget the same fault is served
    vbars.set_budget(None)
    assert vbars.vbar_fault(second) is not None


def test_stand_in_vbar_evicts_other_models_unpinned_weights(vbars, monkeypatch):
    vbars.set_budget(3 / 1024)
    older, newer = vbars.ModelVBAR(1 << 20, 0), vbars.ModelVBAR(1 << 20, 0)
    older.prioritize()
    kept = older.alloc(2048)
    signature = vbars.vbar_fault(kept)
    newer.prioritize()
    wanted = newer.alloc(2048)
    assert vbars.vbar_fault(wanted) is None  # the older model's weight is pinned (in use): not evicted
    vbars.vbar_unpin(kept)
    assert vbars.vbar_fault(wanted) is not None and older.loaded_size() == 0
    vbars.vbar_unpin(wanted)
    refaulted = vbars.vbar_fault(kept)  # evicted meanwhile: a new signature, ComfyUI copies the weight again
    assert refaulted is not None and not vbars.vbar_signature_compare(refaulted, signature)
    # red control: a vbar that never evicts cannot serve the newer model
    vbars.vbar_unpin(kept)
    monkeypatch.setattr(vbars, "evict", lambda vbar, wanted: 0)
    assert vbars.vbar_fault(wanted) is None
