"""The pack's H3 fix inside raylight's sequence parallelism and FSDP sharding, two ranks on a gloo process group
(tests/hotfix_testing/raylight_usp.py says what runs for real and what is stubbed, and why).

Per case, against a single-process run of the same tiny overflowing H3 (same weights, same inputs): with the pack
in either order of the two injections, raylight's parallel forward and attention stay in place, the pack's stream and
rescale run inside them, and every rank's output equals the single-process run with the pack (float32: the fix's
float32 path is stock's; float16: the fix's own float16 error, here none beyond fp32 rounding); through ComfyUI's own
load (raylight's ON_LOAD callback, then the pack's injection) and after raylight injects again on the injected
model; under raylight's FSDP sharding. Red controls: raylight alone in float16 gives NaN (with and without FSDP).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hotfix_testing import child_pythonpath, raylight_source
from hotfix_testing.raylight_usp import outputs, tiny_dit

pytestmark = [pytest.mark.skipif(not raylight_source.available(), reason="needs ../shared/raylight (raylight's source)"),
              pytest.mark.e2e]  # two processes on a process group: with the other multi-process tests

WORLD = 2
TOLERANCE = 1e-5  # fp32 rounding of outputs up to about 3: the ranks sum their attention in another order


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(comfyui, tmp_path_factory) -> list[dict]:
    """Each rank's results, both ranks run at once."""
    folder = raylight_source.copy_package(tmp_path_factory.mktemp("raylight"))
    out = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "COMFYUI_PATH": comfyui, "PYTHONPATH": child_pythonpath(str(folder), comfyui)}
    port = free_port()
    processes = [subprocess.Popen([sys.executable, "-m", "hotfix_testing.raylight_usp", str(rank), str(WORLD),
                                   str(port), str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for rank in range(WORLD)]
    logs = [process.communicate(timeout=600)[0] for process in processes]
    assert all(process.returncode == 0 for process in processes), "\n".join(log[-3000:] for log in logs)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def single_process(comfyui) -> dict:
    """The same DiT in this process, with the pack's hooks: {dtype name: outputs}."""
    from minimax_hotfix.contract import remove_handles
    from minimax_hotfix.patches.h3_fp16_overflow import FIX, hook_dit

    found = {}
    for dtype in (torch.float16, torch.float32):
        dit = tiny_dit()
        handles = hook_dit(dit, FIX)
        found[str(dtype).removeprefix("torch.")] = outputs(dit, dtype)
        remove_handles(handles)
    return found


def test_raylights_parallel_h3_with_the_pack_equals_a_single_process_run(ranks, single_process, capsys):
    rows = []
    for rank, found in enumerate(ranks):
        for case, result in found["outputs"].items():
            dtype = case.rsplit(", ", 1)[1]
            if isinstance(result, str):
                rows.append((rank, case, "raised", result.strip().splitlines()[-1], "-"))
                continue
            finite = bool(torch.isfinite(result).all())
            diff = (result - single_process[dtype]).abs().max().item() if finite else float("nan")
            rows.append((rank, case, "finite" if finite else "NaN", f"{diff:.2g}", found["in_place"][case]))
    with capsys.disabled():
        print("\nrank | case | output | max |diff| from the single-process run with the pack | in place")
        for row in rows:
            print(" | ".join(map(str, row)))
    for rank, found in enumerate(ranks):
        results, placed = found["outputs"], found["in_place"]
        assert not [case for case, result in results.items() if isinstance(result, str)], results
        for case, result in results.items():
            dtype = case.rsplit(", ", 1)[1]
            assert placed[case]["raylight forward"] and placed[case]["raylight attention"], (rank, case)
            if "raylight alone" in case:
                assert not placed[case]["pack entry"]
                if dtype == "float16":  # the red controls: raylight's parallel H3 in float16 without the pack
                    assert not torch.isfinite(result).all(), (rank, case)
                continue
            assert placed[case]["pack entry"] and placed[case]["pack blocks"], (rank, case)
            assert torch.isfinite(result).all(), (rank, case)
            assert (result - single_process[dtype]).abs().max().item() <= TOLERANCE, (rank, case)
