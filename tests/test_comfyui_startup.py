"""The pack as ComfyUI's start-up loads it (``load_custom_node``, in a process of its own; needs COMFYUI_PATH):
it imports only the contract, the registry, the nodes and the process-wide fixes with their kernels; and a fix file
that raises at import leaves ComfyUI starting with every node of the pack, and the public
``attach_to_transformers_model`` a logged no-op. The broken cases run on a copy of the pack with the fix file broken
in the copy."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minimax_hotfix import api, patches
from minimax_hotfix import registry as pack_registry

ROOT = Path(__file__).resolve().parents[1]
PACK_FOLDERS = ("api.py", "__init__.py", "pyproject.toml", "swap_loaders.py", "contract", "nodes", "registry", "patches",
                "kernels", "diagnostics")
# What ComfyUI's start-up imports of the pack: the contract, the registry, the nodes, the process-wide fixes and the
# kernels two of them run at once (transformers_static_cache's waits for transformers' generation code).
STARTUP_MODULES = ["__init__.py", "api.py", "contract/__init__.py", "contract/on_import.py",
                   "kernels/__init__.py", "kernels/ck_rope_device.py", "kernels/cpu_device_cuda_query.py",
                   "nodes/__init__.py", "nodes/known_error_route.py", "nodes/node_types.py", "nodes/prompt_fixing.py",
                   "nodes/swap_route.py",
                   "patches/__init__.py", "patches/ck_rope_device.py", "patches/cpu_device_cuda_query.py",
                   "patches/transformers_static_cache.py", "registry/__init__.py", "registry/prompt_fixing.py"]
# The fixes that load after start-up, with the first model or the status table: every fix but the process-wide ones
# and transformers_qwen3vl_pos_embed, which loads with the first public call (LOAD makes it before the table is asked).
PER_MODEL_FIXES = [name for name in pack_registry.fix_module_names()
                   if name not in patches.PROCESS_WIDE and name != api.TRANSFORMERS_QWEN3VL_POS_EMBED]
NODE_IDS = ["MiniMaxHotfixApplyCLIP", "MiniMaxHotfixApplyModel", "MiniMaxHotfixApplyRayActors", "MiniMaxHotfixApplyVAE",
            "MiniMaxHotfixCLIPLoader", "MiniMaxHotfixStatus", "MiniMaxHotfixUNETLoader", "MiniMaxHotfixVAELoader"]

LOAD = """
import asyncio, logging, os, sys
from comfy.cli_args import args
args.cpu = True
import nodes, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
stock = set(nodes.NODE_CLASS_MAPPINGS)
before = set(sys.modules)
assert asyncio.run(nodes.load_custom_node(sys.argv[1], ignore=stock)), "ComfyUI failed to load the pack"
print("NODES", sorted(set(nodes.NODE_CLASS_MAPPINGS) - stock))
pack = os.path.realpath(sys.argv[1])
top = next(n for n, m in sys.modules.items() if getattr(m, "__file__", None) == os.path.join(sys.argv[1], "__init__.py"))


def pack_files(names):  # the pack's own modules, by module name: a virtual environment in its folder is not it
    return sorted({os.path.relpath(os.path.realpath(sys.modules[n].__file__), pack) for n in names
                   if (n == top or n.startswith(top + ".")) and getattr(sys.modules[n], "__file__", None)})


print("STARTUP", pack_files(set(sys.modules) - before))
import minimax_hotfix
print("ATTACHED", minimax_hotfix.attach_to_transformers_model(torch.nn.Linear(2, 2)))
"""


def load_in_comfyui(pack: Path, after: str = "") -> subprocess.CompletedProcess:
    """``LOAD``, then ``after``, printing the pack modules ``after`` imported as ``LATER [...]``."""
    code = LOAD + (f"loaded = set(sys.modules)\n{after}\nprint('LATER', pack_files(set(sys.modules) - loaded))\n"
                   if after else "")
    # cwd: ComfyUI's folder, which python -c puts first on the path, as "python main.py" run there
    return subprocess.run([sys.executable, "-c", code, str(pack)], capture_output=True, text=True, timeout=600,
                          cwd=os.environ["COMFYUI_PATH"])


def printed(done: subprocess.CompletedProcess, label: str) -> list:
    return ast.literal_eval(next(line for line in done.stdout.splitlines() if line.startswith(f"{label} "))[len(label):])


def copy_of_the_pack(dest: Path) -> Path:
    pack = dest / "minimax-hotfix"
    pack.mkdir()
    for name in PACK_FOLDERS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, pack / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, pack / name)
    return pack


def test_a_fix_file_raising_at_import_leaves_the_pack_loading_and_the_public_attach_a_logged_no_op(comfyui,
                                                                                                   tmp_path):
    pack = copy_of_the_pack(tmp_path)
    fix_file = pack / "patches" / "transformers_qwen3vl_pos_embed.py"
    fix_file.write_text(fix_file.read_text() + "\nraise RuntimeError('broken on purpose')\n")
    done = load_in_comfyui(pack)
    assert done.returncode == 0, done.stderr
    assert f"NODES {NODE_IDS}" in done.stdout
    assert "ATTACHED []" in done.stdout
    log = done.stdout + done.stderr
    assert "fix module transformers_qwen3vl_pos_embed failed to import and is left off: broken on purpose" in log
    assert "transformers_qwen3vl_pos_embed not attached: its module failed to import (RuntimeError: broken on " \
           "purpose)" in log


@pytest.mark.parametrize("fix_id", ["ck_rope_device", "cpu_device_cuda_query", "transformers_static_cache"])
def test_a_process_wide_fix_file_raising_at_start_up_leaves_the_pack_loading(comfyui, tmp_path, fix_id):
    """The process-wide fixes are the fix files ComfyUI's start-up imports; one of them broken is left off alone."""
    pack = copy_of_the_pack(tmp_path)
    fix_file = pack / "patches" / f"{fix_id}.py"
    fix_file.write_text(fix_file.read_text() + "\nraise RuntimeError('broken on purpose')\n")
    done = load_in_comfyui(pack)
    assert done.returncode == 0, done.stderr
    assert f"NODES {NODE_IDS}" in done.stdout
    assert f"fix module {fix_id} failed to import and is left off: broken on purpose" in done.stdout + done.stderr


def test_start_up_imports_only_what_runs_inside_comfyui(comfyui):
    """No self-test, diagnostics, report or per-model fix module at start-up: per-model fixes load with the first
    model they may attach to. Red control: the same process imports them all once a fix table is asked for."""
    done = load_in_comfyui(ROOT, after="from minimax_hotfix.registry.status_table import status_table; status_table()")
    assert done.returncode == 0, done.stderr
    assert printed(done, "STARTUP") == STARTUP_MODULES
    assert {f"patches/{fix_id}.py" for fix_id in PER_MODEL_FIXES} <= set(printed(done, "LATER"))


def test_the_same_copy_unbroken_loads_its_fix_file(comfyui, tmp_path):
    """The control: unbroken, the copy loads the same way and its fix file imports (the model has no tower: [])."""
    done = load_in_comfyui(copy_of_the_pack(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"NODES {NODE_IDS}" in done.stdout and "ATTACHED []" in done.stdout
    assert "failed to import" not in done.stdout + done.stderr
