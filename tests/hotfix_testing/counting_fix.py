"""A test fix that counts the forward calls it sees, and the tiny model it is attached to; shared by the registry's,
the nodes' and the random-state tests."""

import torch
from torch import nn

from minimax_hotfix.contract import AttributeOverride, Fix, State, Status


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


class CountingFix(Fix):
    """Counts forward calls through a pre-hook on every Linear and marks the model, all via an injection; keeps the
    patchers it was told are the pack's own (``on_own_patcher``)."""

    id = "test_counting"
    targets = ("model",)

    def __init__(self):
        self.calls = 0
        self.own_patchers = []

    def on_own_patcher(self, patcher):
        self.own_patchers.append(patcher)

    def detect(self):
        return Status(State.NEEDED, "test fix")

    def count(self, module, args):
        self.calls += 1

    def hook_loaded_model(self, model):
        hooks = [m.register_forward_pre_hook(self.count) for m in model.modules() if isinstance(m, nn.Linear)]
        return hooks + [AttributeOverride(model, "hotfixed", True)]
