"""The placement audit's recorder (diagnostics/placement_recorder.py) on a tiny module, without ComfyUI: which copies of an
offloaded weight are ComfyUI's cast (counted apart) and which a module makes of another module's weight (listed)."""

import torch

from minimax_hotfix.diagnostics.placement_recorder import COMPUTE, PlacementRecorder


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(64))

    def forward(self, x):
        return x * self.weight.to(x.device)  # its own weight, as a casting op brings it: a weight cast


class Attention(torch.nn.Module):
    """As the H3 DiT's attention: its q norm runs as a module, and its weight is also copied by the parent."""

    def __init__(self):
        super().__init__()
        self.q_norm = Norm()

    def forward(self, x):
        return self.q_norm(x) + self.q_norm.weight.to(x.device)  # a child's weight, bypassing the child's op


def test_a_module_copying_a_childs_weight_is_listed_its_own_cast_is_not():
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        model = Attention()  # weights on the CPU, as a partial load leaves them
        x = torch.empty(64, device=COMPUTE)
    recorder = PlacementRecorder(fake_mode, model)
    with torch.no_grad(), recorder.watching_modules(model), fake_mode, recorder:
        model(x)
    assert (recorder.weight_casts, recorder.weight_cast_bytes) == (1, 256)
    assert [(f.kind, f.module, f.tensor, f.calls, f.bytes) for f in recorder.findings.values()] == [
        ("host-to-device", "Attention", "q_norm.weight", 1, 256)]
