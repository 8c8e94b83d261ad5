"""kernels/int8_full_precision_mm.py: the per-device int8 probe and the dequantized-weight cache (no ComfyUI needed)."""

import pytest
import torch
from comfy_kitchen.tensor import QuantizedTensor

from minimax_hotfix.diagnostics.self_tests.int8_full_precision_mm import forget_int8_probes
from minimax_hotfix.kernels.int8_full_precision_mm import DequantizedWeightCache, int8_compute_available

MPS_INT_MM_ERROR = "The operator 'aten::_int_mm' is not currently implemented for the MPS device."


@pytest.fixture(autouse=True)
def fresh_probes():
    forget_int8_probes()
    yield
    forget_int8_probes()


def counting_int_mm(monkeypatch, behaviour):
    calls = []

    def int_mm(a, b):
        calls.append(a.device)
        return behaviour(a, b)

    monkeypatch.setattr(torch, "_int_mm", int_mm)
    return calls


def raise_mps_error(a, b):
    raise NotImplementedError(MPS_INT_MM_ERROR)


def test_probe_runs_the_op_once_per_device(monkeypatch):
    calls = counting_int_mm(monkeypatch, torch._int_mm)
    assert int8_compute_available("cpu") and int8_compute_available(torch.device("cpu"))
    assert calls == [torch.device("cpu")], "the probe must be cached per device"


def test_probe_reports_a_missing_op_as_no_int8_compute(monkeypatch):
    counting_int_mm(monkeypatch, raise_mps_error)
    assert not int8_compute_available("cpu")

    forget_int8_probes()
    counting_int_mm(monkeypatch, lambda a, b: (_ for _ in ()).throw(RuntimeError("no kernel image")))
    assert not int8_compute_available("cpu")


# cuBLASLt's answer to an int8 GEMM on a V100 (compute capability 7.0: Volta's tensor cores have no int8 mode), as
# reported in pytorch/pytorch#106840. ComfyUI's supports_int8_compute says yes to every NVIDIA device, so the int8
# layers reach it there; the pack decides by this behaviour, not by a list of cards.
VOLTA_INT_MM_ERROR = ("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul with transpose_mat1 0 "
                      "transpose_mat2 0 m 16 n 17 k 16 mat1_ld 16 mat2_ld 16 result_ld 16 abType 3 cType 10 "
                      "computeType 72 scaleType 10")


def test_probe_reports_cublaslt_refusing_int8_as_no_int8_compute(monkeypatch):
    """Red control: the same device with the real op answers True."""
    assert int8_compute_available("cpu")
    forget_int8_probes()
    counting_int_mm(monkeypatch, lambda a, b: (_ for _ in ()).throw(RuntimeError(VOLTA_INT_MM_ERROR)))
    assert not int8_compute_available("cpu")


def test_probe_rejects_an_op_that_returns_wrong_numbers(monkeypatch):
    counting_int_mm(monkeypatch, lambda a, b: torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32))
    assert not int8_compute_available("cpu")


def test_probe_does_not_go_by_device_name():
    """A device whose op exists answers True whatever it is called; meta has a shape-only _int_mm and no data."""
    assert int8_compute_available("cpu")
    assert not int8_compute_available("meta")


def int8_weight(seed=0, shape=(32, 64)):
    torch.manual_seed(seed)
    return torch.nn.Parameter(QuantizedTensor.from_float(torch.randn(*shape), "TensorWiseINT8Layout"),
                              requires_grad=False)


def counting_cache(may_keep=lambda nbytes, device: True):
    made = []

    def dequantize(weight, dtype):
        made.append(dtype)
        return weight.to(dtype=dtype).dequantize()

    return DequantizedWeightCache(dequantize, may_keep), made


def test_cache_dequantizes_an_unchanged_weight_once():
    cache, made = counting_cache()
    weight = int8_weight()
    first = cache.get(weight, torch.float32)
    assert cache.get(weight, torch.float32) is first and made == [torch.float32]
    assert torch.equal(first, weight.dequantize())
    assert cache.nbytes == 32 * 64 * 4


def test_cache_follows_a_replaced_weight_an_in_place_write_and_the_dtype():
    cache, made = counting_cache()
    weight = int8_weight()
    cache.get(weight, torch.float32)

    replaced = int8_weight(seed=1)  # what a move or a LoRA patch does: a new Parameter
    assert torch.equal(cache.get(replaced, torch.float32), replaced.dequantize())

    replaced._qdata.mul_(-1)  # an in-place write into the int8 payload
    assert torch.equal(cache.get(replaced, torch.float32), replaced.dequantize())

    assert cache.get(replaced, torch.bfloat16).dtype == torch.bfloat16
    assert made == [torch.float32] * 3 + [torch.bfloat16]
    assert cache.nbytes == 32 * 64 * 2, "only the current copy stays resident"


def test_cache_keeps_nothing_the_memory_guard_refuses():
    cache, made = counting_cache(may_keep=lambda nbytes, device: False)
    weight = int8_weight()
    assert torch.equal(cache.get(weight, torch.float32), cache.get(weight, torch.float32))
    assert len(made) == 2 and cache.nbytes == 0
