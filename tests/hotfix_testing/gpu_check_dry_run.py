"""The GPU check (benchmarks/gpu_check.py) run whole without a GPU: simulated devices stand in for CUDA, and the
check's own ``main`` runs its parts side by side as on a GPU machine, so its wall time per part is measured before a
device is lent (docs/testing.md, "The GPU check", "Time").

    PYTHONPATH=tests:tools .venv-comfyui/bin/python -m hotfix_testing.gpu_check_dry_run --comfyui PATH [--servers N]
        [--parts ...]

PATH: a ComfyUI tree the simulated device runs on (a simulated core: tests/hotfix_testing/simulated_cores.py). The
parts that time CUDA itself (``CUDA_ONLY_PARTS``) are left out: their dry runs are the tests of their benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

FREE_MB = 2048.0  # what each stand-in device has free, as ComfyUI reads it
CUDA_ONLY_PARTS = ("music3_graph_capture", "h3_fp16_overflow")


def stand_in_for_cuda(monkeypatch: pytest.MonkeyPatch, gpu_check, without_frontend: Path,
                      emulated_graphs: bool = False) -> None:
    """Makes the check's servers start on two simulated devices instead of CUDA: FREE_MB free each, their matmuls and
    convolutions off the CPU's in the last bit as a GPU's, ``emulated_graphs`` for the Music 3 AR loop; started as the
    recipe for a bare CUDA machine says (no frontend package: ``without_frontend`` holds one that cannot be
    imported)."""
    from hotfix_testing import comfyui_server

    def cuda_device(index=0, text_encoder=False, dynamic_vram=False):
        return comfyui_server.SimulatedDevice(total_mb=FREE_MB, current=index, force_fp32=not text_encoder,
                                              dynamic_vram=dynamic_vram, last_bit_differs=True,
                                              emulated_graphs=emulated_graphs)

    package = without_frontend / "comfyui_frontend_package"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('raise ImportError("not installed: the bare-machine recipe leaves the '
                                         'frontend out")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(without_frontend),
                                                                   os.environ.get("PYTHONPATH")))))
    monkeypatch.setattr(comfyui_server, "CudaDevice", cuda_device)
    monkeypatch.setattr(gpu_check, "free_mb_of", lambda *args: FREE_MB)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def main(argv=None) -> int:
    from minimax_hotfix.benchmarks import gpu_check
    from minimax_hotfix.diagnostics.comfyui_checkout import use_comfyui_checkout

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", type=Path, required=True)
    parser.add_argument("--servers", default="2", help="the check's --servers (default 2)")
    parser.add_argument("--parts", default=",".join(part for part in gpu_check.PARTS if part not in CUDA_ONLY_PARTS),
                        help="the check's --parts (default: every part but CUDA_ONLY_PARTS)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="minimax-hotfix-gpu-check-dry-run-") as work, \
            pytest.MonkeyPatch.context() as monkeypatch:
        stand_in_for_cuda(monkeypatch, gpu_check, Path(work) / "without_frontend", emulated_graphs=True)
        use_comfyui_checkout(str(args.comfyui))  # what the check's CUDA test would have let it do
        monkeypatch.setattr(gpu_check, "cannot_run", lambda check_args: None)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"simulated accelerator {index}")
        out = Path(work) / "report.json"
        status = gpu_check.main(["--comfyui", str(args.comfyui), "--out", str(out), "--parts", args.parts,
                                 "--servers", args.servers])
        report = json.loads(out.read_text())
    print(json.dumps({"exit": status, "wall_s": report["wall_s"], "failed_checks": report["failed_checks"],
                      **{f"{part}_wall_s": report.get(f"{part}_wall_s") for part in args.parts.split(",")}}, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
