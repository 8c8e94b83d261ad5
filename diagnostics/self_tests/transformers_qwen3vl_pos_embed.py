"""Self-test of transformers_qwen3vl_pos_embed, and the tiny transformers Qwen3-VL vision tower it (and the tests) run:
unpatched, ``pos_embed`` on another device than the activations fails (red); patched it runs, equal to the all-on-cpu
reference on a real accelerator (green); all on cpu, bit-identical to the unpatched tower."""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from ...contract import Check, remove_handles
from ...kernels.fake_cuda import fake_cuda_mode, on_fake_cuda
from ...kernels.qwen3vl_pos_embed import computing_on
from ...patches.transformers_qwen3vl_pos_embed import INDEXING_FORM, forward_form, hook_tower, reference_tower_class
from ..devices import real_accelerator


def tiny_tower(seed: int = 0):
    """A random 2-block Qwen3-VL vision tower (hidden 32, 16 positions), on CPU, for tests and the self-test."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    tower_class = reference_tower_class()
    config = Qwen3VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                                 patch_size=4, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=40,
                                 num_position_embeddings=16, deepstack_visual_indexes=[0])
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):  # seeded weights, the caller's random state left as it was
        torch.default_generator.manual_seed(seed)
        return tower_class(config).eval()


TINY_GRID = ((1, 4, 6), (2, 2, 2))


def tiny_inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    patches = sum(t * h * w for t, h, w in TINY_GRID)
    pixels = torch.randn(patches, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))
    return pixels, torch.tensor(TINY_GRID)


def outputs(result) -> list[torch.Tensor]:
    return [result.last_hidden_state, result.pooler_output, *result.deepstack_features]


@contextlib.contextmanager
def _installed(tower, form: str):
    """The fix on the self-test's private ``tower`` for one step of the check."""
    handles = hook_tower(tower, form)
    try:
        yield
    finally:
        remove_handles(handles)


def _fails_check(name: str, call) -> Check:
    """A red control: passes when ``call`` raises the device-mismatch RuntimeError."""
    try:
        call()
    except RuntimeError as exc:
        return Check(name, True, str(exc).splitlines()[0][:120])
    return Check(name, False, "it ran")


def self_test() -> Iterable[Check]:
    if reference_tower_class() is None:
        return ()
    tower = tiny_tower()
    form = forward_form(type(tower))
    pixels, grid = tiny_inputs()
    with torch.no_grad():
        reference = outputs(tower(pixels, grid))
        with _installed(tower, form):
            patched = outputs(tower(pixels, grid))
    all_on_cpu = Check("green: all on cpu, outputs bit-identical to the unpatched tower",
                       all(map(torch.equal, patched, reference)))
    return [*cross_device_checks(tower, form, pixels, grid, reference), all_on_cpu]


def cross_device_checks(tower, form: str, pixels, grid, reference) -> Iterable[Check]:
    """Red/green with ``pos_embed`` on another device than the activations: end to end on a real accelerator;
    on a CPU-only machine with the stand-in each form allows (see docs/qwen3vl_pos_embed.md)."""
    accelerator = real_accelerator()
    if accelerator is None and form == INDEXING_FORM:
        yield from fake_cuda_gather_checks(tower, len(pixels))
        return
    with torch.no_grad():
        if accelerator is not None:
            tower.to(accelerator)
            tower.pos_embed.to("cpu")
            args = (pixels.to(accelerator), grid.to(accelerator))
            label = f"pos_embed on cpu, compute on {accelerator.type}"
        else:
            offloaded = torch.nn.Parameter(tower.pos_embed.weight.detach().clone())
            tower.to("meta")
            tower.pos_embed.weight = offloaded
            args = (pixels.to("meta"), grid)
            label = "pos_embed on cpu, compute on meta"
        yield _fails_check(f"red: unpatched, {label}: forward fails", lambda: tower(*args))
        with _installed(tower, form):
            try:
                fixed = outputs(tower(*args))
            except Exception as exc:
                yield Check(f"green: patched, {label}: forward runs", False, f"{type(exc).__name__}: {exc}")
                return
    if accelerator is None:
        passed = all(t.device.type == "meta" for t in fixed) and [t.shape for t in fixed] == [
            t.shape for t in reference]
        yield Check(f"green: patched, {label}: forward runs, outputs on meta with the right shapes", passed)
    else:
        passed = all(torch.allclose(a.cpu(), b, rtol=1e-5, atol=1e-6) for a, b in zip(fixed, reference, strict=True))
        yield Check(f"green: patched, {label}: outputs equal the all-on-cpu reference", passed)


def fake_cuda_gather_checks(tower, patches: int) -> Iterable[Check]:
    """Indexing form without an accelerator: its forward needs grid data on the compute device, so only the gather
    is checked, with the weight on a FakeTensor cuda:0 and the call computing on the CPU."""
    indices = torch.randint(0, tower.pos_embed.num_embeddings, (patches, 4), generator=torch.Generator().manual_seed(2))
    label = "pos_embed on (fake) cuda:0, compute on cpu"
    with fake_cuda_mode() as mode:
        tower.pos_embed.weight = torch.nn.Parameter(on_fake_cuda(mode, tower.pos_embed.weight), requires_grad=False)
        with computing_on(tower, torch.device("cpu")):
            yield _fails_check(f"red: unpatched, {label}: the gather fails", lambda: tower.pos_embed(indices))
            with _installed(tower, INDEXING_FORM):
                rows = tower.pos_embed(indices)
    yield Check(f"green: patched, {label}: the rows come back on cpu",
                rows.device.type == "cpu" and rows.shape == (patches, 4, tower.pos_embed.embedding_dim))
