"""A second device on any machine: FakeTensor "cuda" tensors on CPU, which raise the same "Expected all tensors to be
on the same device" text as CUDA and carry no data (values are compared on real devices only). ``.to("cuda")`` fails
on a CPU-only torch, so fake tensors are made with ``on_fake_cuda``."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def fake_cuda_mode():
    """A FakeTensorMode that lets ops mix in real CPU tensors (as an offloaded weight would be)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        yield mode


def on_fake_cuda(mode, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a FakeTensor on cuda:0 (shape, dtype and strides kept, no data)."""
    from torch._subclasses.fake_tensor import FakeTensor

    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        meta = tensor.detach().to("meta")
    return FakeTensor(mode, meta, torch.device("cuda", 0))
