"""qwen3vl_rotary_table: the host time and the bytes over the bus that the fix removes from each vision-tower call,
stock and fixed side by side in one run, at the MiniMax H3 text encoder's vision size (hidden 1152, 16 heads).

    COMFYUI_PATH=... <ComfyUI's python> benchmarks/qwen3vl_rotary_table.py

The rotary module's ``inv_freq`` sits in CPU RAM (a legacy partial load) and the compute device is meta, the CPU-only
stand-in. Per call, stock builds the positions and the table on the CPU and ``forward`` copies the N x 36 float32
table over (from pageable memory: the host waits for the copy); the fix builds it on the compute device from a
resident copy of ``inv_freq``. Printed per call, both counted in one run: the ops that compute on the CPU and their
time, the ops dispatched to the compute device (kernel launches on a GPU), and the bytes copied from the host.
Host time is the CPU ops' own time: meta's Python dispatch is far slower than a CUDA launch, so the wall time of the
fixed call on meta says nothing about a GPU.
"""

import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # run by path: tools/minimax_hotfix is the pack (docs/testing.md, "How the tests import the pack")

from minimax_hotfix.diagnostics.comfyui_checkout import use_comfyui_checkout  # noqa: E402
from minimax_hotfix.diagnostics.devices import HostToDeviceCopies  # noqa: E402
from minimax_hotfix.kernels.qwen3vl_pos_embed import computing_on  # noqa: E402

META = torch.device("meta")
INPUTS = {"1024x1024 reference image": [[1, 64, 64]], "4-frame 448x448 clip": [[2, 28, 28]],
          "two 512x512 images": [[1, 32, 32], [1, 32, 32]]}


def h3_tower():
    """The H3 vision tower's geometry on meta (no weights allocated), its rotary module's buffer in CPU RAM."""
    import comfy.ops
    from comfy.text_encoders.qwen3vl import QWEN3VL_VISION, QWEN3VL_VISION_COMMON, Qwen3VLVisionModel
    from comfy.text_encoders.qwen35 import Qwen35VisionRotaryEmbedding

    config = {**QWEN3VL_VISION_COMMON, **QWEN3VL_VISION["qwen3vl_32b"], "out_hidden_size": 64, "depth": 0,
              "deepstack_visual_indexes": []}
    with torch.device("meta"):
        tower = Qwen3VLVisionModel(config, dtype=torch.bfloat16, ops=comfy.ops.manual_cast)
    tower.rotary_pos_emb = Qwen35VisionRotaryEmbedding(tower.hidden_size // tower.num_heads // 2)
    return tower


def table_on_compute_device(tower, grid):
    """What ``forward`` does with the rotary table: build it, move it to the activations' device."""
    with computing_on(tower, META):
        return tower.rot_pos_emb(grid).to(META)


class OpsByDevice(TorchDispatchMode):
    """Counts, while active, the ops computing on the CPU (and their time) and those dispatched elsewhere."""

    def __init__(self):
        super().__init__()
        self.cpu_ops, self.cpu_seconds, self.device_ops = 0, 0.0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first, torch.Tensor) and first.device.type == "cpu":
            self.cpu_ops += 1
            self.cpu_seconds += time.perf_counter() - start
        else:
            self.device_ops += 1
        return out


def per_call(call, rounds=20):
    """Ops by device, CPU milliseconds (fastest round) and bytes copied from the host, for one ``call()``."""
    fastest = None
    for _ in range(rounds):
        with HostToDeviceCopies() as copies, OpsByDevice() as ops:
            call()
        if fastest is None or ops.cpu_seconds < fastest[1].cpu_seconds:
            fastest = (copies, ops)
    copies, ops = fastest
    return ops.cpu_ops, ops.cpu_seconds * 1e3, ops.device_ops, sum(s.nbytes for s in copies.sources)


def main() -> None:
    if use_comfyui_checkout() is None:
        print("needs a ComfyUI checkout: set COMFYUI_PATH")
        return
    from minimax_hotfix.patches import qwen3vl_rotary_table as fix

    torch.set_num_threads(1)
    stock_tower, fixed_tower = h3_tower(), h3_tower()
    fix.hook_towers(fixed_tower)
    for name, rows in INPUTS.items():
        grid = torch.tensor(rows)
        patches = sum(t * h * w for t, h, w in rows)
        stock = lambda grid=grid: table_on_compute_device(stock_tower, grid)  # noqa: E731
        fixed = lambda grid=grid: table_on_compute_device(fixed_tower, grid)  # noqa: E731
        fixed()  # the fix's one resident copy of inv_freq
        stock_cpu, stock_ms, stock_device, stock_bytes = per_call(stock)
        fixed_cpu, fixed_ms, fixed_device, fixed_bytes = per_call(fixed)
        print(f"H3 vision rotary table, {name} ({patches} patches), per call: stock {stock_cpu} CPU ops in "
              f"{stock_ms:.2f} ms + {stock_device} device ops, {stock_bytes / 1e3:.0f} kB from the host | fixed "
              f"{fixed_cpu} CPU ops in {fixed_ms:.2f} ms + {fixed_device} device ops, {fixed_bytes} bytes from the "
              f"host | fixed/stock: CPU time {fixed_ms / stock_ms:.3f}, bytes {fixed_bytes / stock_bytes:.3f}")


if __name__ == "__main__":
    main()
