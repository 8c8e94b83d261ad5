"""How a capability query answers on another machine, and the wrapper that answers for non-CUDA devices.

* ``on_machine(query, nvidia)``: a copy of a query function whose module sees an NVIDIA machine (``is_nvidia()`` true,
  CUDA present) or one without CUDA; its CUDA device lookups refuse every device as torch refuses a CPU device, so no
  CUDA is needed to ask. ``asks_cuda_about_the_cpu`` runs it for a CPU device.
* ``guarded(query, on_cpu_answer)``: the query as it is for CUDA devices, its answer as on a machine without CUDA for
  any other device; ``unguarded`` finds the query behind it.

No ComfyUI imports here: the queries are handed in.
"""

from __future__ import annotations

import functools
import types

import torch

# set on each wrapper (to itself), so a wrapper another pack copies it into with functools.wraps is not taken for ours
MARK = "_minimax_hotfix_cpu_device_cuda_query"


class CudaRefusedDevice(ValueError):
    """Raised by a machine view's CUDA device lookup, with torch's own text for a CPU device."""


def _refuse(device=None, *args, **kwargs):
    raise CudaRefusedDevice(f"Expected a cuda device, but got: {device}")


class _CudaOnMachine:
    """``torch.cuda`` as a query sees it on another machine: CUDA present or not, and every device lookup refused as
    torch refuses a CPU device (the views are only ever asked about non-CUDA devices); the rest is the real module."""

    get_device_properties = get_device_capability = get_device_name = staticmethod(_refuse)

    def __init__(self, present: bool):
        self._present = present

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    def is_available(self) -> bool:
        return self._present


class _TorchOnMachine:
    def __init__(self, cuda: _CudaOnMachine):
        self.cuda = cuda

    def __getattr__(self, name):
        return getattr(torch, name)


def on_machine(query, nvidia: bool):
    """A copy of ``query`` whose module globals see an NVIDIA machine (``is_nvidia()`` true, CUDA present) or one
    without CUDA; everything else it uses is the real thing."""
    machine = {"is_nvidia": lambda: nvidia, "torch": _TorchOnMachine(_CudaOnMachine(present=nvidia))}
    copy = types.FunctionType(query.__code__, {**query.__globals__, **machine}, query.__name__, query.__defaults__,
                              query.__closure__)
    copy.__kwdefaults__ = query.__kwdefaults__
    return copy


def asks_cuda_about_the_cpu(query, nvidia: bool = True) -> bool:
    """Whether ``query``, on an NVIDIA machine (or one without CUDA), asks CUDA about a CPU device: where torch
    raises the bug's error."""
    try:
        on_machine(query, nvidia)(torch.device("cpu"))
    except CudaRefusedDevice:
        return True
    return False


def names_a_cuda_device(device) -> bool:
    return device is None or isinstance(device, int) or torch.device(device).type == "cuda"


def guarded(query, on_cpu_answer):
    """``query`` for CUDA devices; for any other device its answer as on a machine without CUDA, then
    ``on_cpu_answer(name, device, answer)``."""

    @functools.wraps(query)
    def wrapper(device=None, *args, **kwargs):
        if names_a_cuda_device(device):
            return query(device, *args, **kwargs)
        answer = on_machine(query, nvidia=False)(device, *args, **kwargs)
        on_cpu_answer(query.__name__, device, answer)
        return answer

    setattr(wrapper, MARK, wrapper)
    return wrapper


def unguarded(function):
    """``function`` past this fix's wrapper (not past another pack's)."""
    return function.__wrapped__ if getattr(function, MARK, None) is function else function
