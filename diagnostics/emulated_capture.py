"""CUDA-graph stream-capture rules for host copies, on any build, so the capture policy (kernels/music3_graph_capture.py)
can be checked without a GPU: PyTorch raises "Cannot copy between CPU and CUDA tensors during CUDA graph capture
unless the CPU tensor is pinned." for a copy from pageable host memory during capture."""

from __future__ import annotations

import contextlib
import threading

import torch
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


@contextlib.contextmanager
def _host_data_rule(host_data_is_copy):
    """``torch.tensor(<Python data>, device=gpu)`` stages the data in pageable host memory, then copies it over.
    ``torch.tensor`` and ``torch.as_tensor`` themselves are replaced for as long as the capture lasts, in the
    capturing thread only: a tensor subclass's ``__torch_dispatch__`` (a GGUF weight dequantized inside
    ``F.linear``) runs with no torch-function mode active, and its factories must meet the rule too."""
    capturing = threading.get_ident()
    originals = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def ruled(factory):
        def factory_under_capture(data=None, *args, **kwargs):
            if threading.get_ident() == capturing:
                if host_data_is_copy and not isinstance(data, torch.Tensor):
                    raise RuntimeError(CAPTURE_HOST_COPY_ERROR)
                _refuse_host_copy(data, kwargs.get("device"))
            return factory(data, *args, **kwargs)
        return factory_under_capture

    for name, factory in originals.items():
        setattr(torch, name, ruled(factory))
    try:
        yield
    finally:
        for name, factory in originals.items():
            setattr(torch, name, factory)


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
    with _host_data_rule(host_data_is_copy), _HostCopyRule():
        yield
