"""A fix file that raises at import leaves ComfyUI starting with every node of the pack, and the public
``attach_to_transformers_model`` a logged no-op (needs COMFYUI_PATH). The pack is copied, the fix file broken in the
copy, and ComfyUI's ``load_custom_node`` loads it in a process of its own."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACK_FOLDERS = ("api.py", "__init__.py", "pyproject.toml", "nodes", "registry", "patches", "kernels", "diagnostics")
NODE_IDS = ["MiniMaxHotfixApplyCLIP", "MiniMaxHotfixApplyModel", "MiniMaxHotfixApplyVAE", "MiniMaxHotfixCLIPLoader",
            "MiniMaxHotfixStatus", "MiniMaxHotfixUNETLoader", "MiniMaxHotfixVAELoader"]

LOAD = """
import asyncio, logging, os, sys
sys.path.insert(0, os.environ["COMFYUI_PATH"]); os.chdir(os.environ["COMFYUI_PATH"])
from comfy.cli_args import args
args.cpu = True
import nodes, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
stock = set(nodes.NODE_CLASS_MAPPINGS)
assert asyncio.run(nodes.load_custom_node(sys.argv[1], ignore=stock)), "ComfyUI failed to load the pack"
print("NODES", sorted(set(nodes.NODE_CLASS_MAPPINGS) - stock))
import minimax_hotfix
print("ATTACHED", minimax_hotfix.attach_to_transformers_model(torch.nn.Linear(2, 2)))
"""


def load_in_comfyui(pack: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD, str(pack)], capture_output=True, text=True, timeout=600)


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


def test_the_same_copy_unbroken_loads_its_fix_file(comfyui, tmp_path):
    """The control: unbroken, the copy loads the same way and its fix file imports (the model has no tower: [])."""
    done = load_in_comfyui(copy_of_the_pack(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"NODES {NODE_IDS}" in done.stdout and "ATTACHED []" in done.stdout
    assert "failed to import" not in done.stdout + done.stderr
