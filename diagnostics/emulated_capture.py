"""CUDA-graph stream-capture rules for host copies, on any build, so the capture policy (kernels/music3_graph_capture.py)
can be checked without a GPU: PyTorch raises "Cannot copy between CPU and CUDA tensors during CUDA graph capture
unless the CPU tensor is pinned." for a copy from pageable host memory during capture."""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..kernels.music3_graph_capture import decide_unit, is_pageable_host_tensor

CAPTURE_HOST_COPY_ERROR = (
    "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned."
)


def capture_allowed_on(device):
    """``decide_unit`` as a graph runner's ``capture_allowed(module)``, for units of one root module."""
    return lambda unit: decide_unit((unit,), device).capture


def _refuse_host_copy(source, target) -> None:
    if target is not None and torch.device(target).type != "cpu":
        if not isinstance(source, torch.Tensor) or is_pageable_host_tensor(source):
            raise RuntimeError(CAPTURE_HOST_COPY_ERROR)


class _HostDataRule(TorchFunctionMode):
    """``torch.tensor(<Python data>, device=gpu)`` stages the data in pageable host memory, then copies it over."""

    def __init__(self, host_data_is_copy):
        super().__init__()
        self.host_data_is_copy = host_data_is_copy

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor):
            data = args[0] if args else kwargs.get("data")
            if self.host_data_is_copy and not isinstance(data, torch.Tensor):
                raise RuntimeError(CAPTURE_HOST_COPY_ERROR)
            _refuse_host_copy(data, kwargs.get("device"))
        return func(*args, **kwargs)


class _HostCopyRule(TorchDispatchMode):
    """A pageable host tensor copied to the device, by ``.to()``/``copy_`` or inside any op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
            if isinstance(source, torch.Tensor):
                _refuse_host_copy(source, target)
        return func(*args, **kwargs)


@contextlib.contextmanager
def emulated_capture(host_data_is_copy=False):
    """Stream-capture rules for host copies, on any build. On a CPU build, ``meta`` tensors stand in for the
    capturing GPU (FakeTensor ``cuda`` cannot run in-place methods there); for code that must run on real CPU
    tensors, ``host_data_is_copy`` counts every tensor made from Python data as the host copy it is on a GPU."""
    with _HostDataRule(host_data_is_copy), _HostCopyRule():
        yield
