"""The simulated accelerator (tests/simulated_device) that the end-to-end scenario runs use: its own checks
(tests/simulated_device/accelerator_checks.py, in a process of their own: installing the device patches torch for
the whole process), and ComfyUI's own ``load_models_gpu`` splitting a model by its accounting. Each check has its red
control."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from hotfix_testing.nested_pytest import pytest_command

SIMULATED_DEVICE = Path(__file__).with_name("simulated_device")
CHECKS = SIMULATED_DEVICE / "accelerator_checks.py"


def test_the_accelerators_own_checks_pass_in_a_process_of_their_own():
    names = [node.name for node in ast.parse(CHECKS.read_text()).body
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    done = subprocess.run(pytest_command(str(CHECKS), "-rA"), cwd=Path(__file__).parents[1], capture_output=True,
                          text=True, timeout=600, check=False)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert all(f"PASSED {CHECKS.relative_to(Path(__file__).parents[1])}::{name}" in done.stdout
               for name in names), done.stdout[-6000:]


PARTIAL_LOAD_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from comfy.cli_args import args
    args.disable_pinned_memory = args.force_fp32 = True
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.ops

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = comfy.ops.manual_cast.Linear(1024, 1024)
            self.register_buffer("scale", torch.full((1024,), 0.5), persistent=False)

        def forward(self, x):
            return self.linear(x) * self.scale

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(16)])  # 16 x 4 MiB of weights
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape) / 32)
    x = torch.randn(2, 1024)
    with torch.no_grad():
        reference = model(x)
    size = comfy.model_management.module_size(model)
    reserve = mm.minimum_inference_memory()  # what load_models_gpu keeps free for inference
    import simulated_accelerator
    results = {"device": str(mm.get_torch_device()), "size_mb": size / 2**20, "runs": []}
    for fraction in (0.5, 0.8, 1.5):
        total_mb = (reserve + fraction * size) / 2**20
        simulated_accelerator.set_total_mb(total_mb)
        patcher = comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                                   offload_device=torch.device("cpu"))
        mm.load_models_gpu([patcher])
        loaded = patcher.loaded_size()
        try:
            with torch.inference_mode():
                out = model(x.to(mm.get_torch_device()))
            outcome = {"max_abs_diff": (out.cpu() - reference).abs().max().item()}
        except RuntimeError as exc:
            outcome = {"error": str(exc).splitlines()[0]}
        results["runs"].append({"total_mb": total_mb, "loaded_mb": loaded / 2**20, **outcome})
        mm.unload_all_models()
    print("RESULT " + json.dumps(results))
''')


def test_comfyui_splits_a_model_by_the_devices_accounting(comfyui, tmp_path):
    """ComfyUI 0.33.0's ``load_models_gpu`` at three totals, deciding the split itself: half, 80 % and all of a
    64 MiB model. Red control: under a partial load a non-persistent buffer stays on the CPU and the forward raises
    the device's mixed-device error; at full load the output is the CPU's bit for bit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SIMULATED_DEVICE), comfyui])}
    script = tmp_path / "partial_load.py"
    script.write_text("import torch_npu\n" + PARTIAL_LOAD_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], cwd=comfyui, env=env, capture_output=True, text=True,
                          check=False, timeout=300)
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")] or [done.stderr[-3000:]]
    results = json.loads(line.removeprefix("RESULT "))
    print(f"\nComfyUI on {results['device']}, model {results['size_mb']:.1f} MiB:")
    for run in results["runs"]:
        print(f"  total {run['total_mb']:.1f} MiB: loaded {run['loaded_mb']:.1f} MiB; "
              + (f"error: {run['error']}" if "error" in run else f"max abs diff vs CPU {run['max_abs_diff']}"))
    assert results["device"] == "npu:0"
    half, most, full = results["runs"]
    assert 0 < half["loaded_mb"] < most["loaded_mb"] < full["loaded_mb"] == results["size_mb"]
    for partial in (half, most):
        assert partial["error"].startswith("Expected all tensors to be on the same device, but found at least two "
                                           "devices, npu:0 and cpu!")
    assert full["max_abs_diff"] == 0


