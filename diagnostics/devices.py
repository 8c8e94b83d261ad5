"""The devices a self-test can use: the real accelerator where there is one (otherwise the self-tests take FakeTensor
"cuda" tensors from kernels/fake_cuda.py, or ``meta``), and a counter of host-to-device copies."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def real_accelerator() -> torch.device | None:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return None


def devices() -> list[str]:
    """The devices of this machine, for a bug report."""
    accelerator = real_accelerator()
    if accelerator is None:
        return ["cpu (a second device is simulated with FakeTensor 'cuda' / meta)"]
    if accelerator.type == "mps":
        return ["mps"]
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append(f"cuda:{index} {props.name} ({props.total_memory / 2**30:.0f} GiB)")
    return found


class HostToDeviceCopies(TorchDispatchMode):
    """Counts, while active, the copies from a CPU tensor to another device (``.to()`` and ``copy_``), keeping
    the source tensors so a caller can tell which were model buffers."""

    def __init__(self):
        super().__init__()
        self.sources: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default:
            source, target = args[0], out
        elif func is torch.ops.aten.copy_.default:
            target, source = args[0], args[1]
        else:
            return out
        if source.device.type == "cpu" and target.device.type != "cpu":
            self.sources.append(source)
        return out

    def __len__(self) -> int:
        return len(self.sources)

    def made_from(self, tensors) -> int:
        """How many of the counted copies were made from one of ``tensors`` (by identity)."""
        wanted = {id(t) for t in tensors}
        return sum(id(source) in wanted for source in self.sources)
