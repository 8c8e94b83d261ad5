"""The global random state a user's seed sets, read without drawing from it: torch's CPU generator, every CUDA
device's where CUDA is present, Python's ``random`` and NumPy's legacy global generator. No pack imports, so a
subprocess can use it before the pack is loaded."""

import collections
import random

import numpy as np
import torch

# fix id -> the paths through fix code whose random state a test checked in this run (listed in the run's summary)
COVERED_PATHS: dict[str, list[str]] = collections.defaultdict(list)


def seed_everything(seed: int = 1234) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def random_state() -> dict:
    state = {"torch (CPU)": torch.random.get_rng_state(), "random": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["torch (CUDA)"] = torch.cuda.get_rng_state_all()
    return state


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def changed_generators(before: dict, after: dict) -> list[str]:
    return [name for name in before if not _equal(before[name], after[name])]


def seeded_draws() -> list:
    """What a seeded run consumes after the pack's code ran: one draw from each watched generator."""
    draws = [torch.rand(4).tolist(), random.random(), np.random.rand(4).tolist()]
    if torch.cuda.is_available():
        draws.append(torch.rand(4, device="cuda").tolist())
    return draws
