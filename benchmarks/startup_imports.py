"""What ComfyUI's start-up imports of the pack, and how long ``load_custom_node`` takes for it, side by side with an
earlier commit of the pack, in one run.

    COMFYUI_PATH=/path/to/ComfyUI <ComfyUI's python> benchmarks/startup_imports.py [--before REV] [--after REV]
        [--repeats 7]

Each measurement is a fresh process that imports what ComfyUI's ``main.py`` has imported before custom nodes load
(``nodes``, ``comfy.model_patcher``, ``server``, and the ``comfy_config`` parser that ComfyUI imports once, for
the first custom node with a ``pyproject.toml``: its ~40 ms belong to no pack), then times ``nodes.load_custom_node(<pack>)`` and lists the pack's
modules that call added to ``sys.modules`` (lines counted per file). The two packs alternate, so drift of a noisy
machine hits both; medians are printed with their ratio. Both commits (``--before``, default 0033aee, the last commit
before the start-up redesign; ``--after``, default HEAD) are extracted with ``git archive`` into a temporary folder.
Timed twice: "cold", Python compiling the pack's sources (a first start, or ``PYTHONDONTWRITEBYTECODE``), and "warm",
from the bytecode cache a user's later starts read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEASURE = """
import asyncio, json, os, sys, time
comfy, pack = os.environ["COMFYUI_PATH"], os.path.realpath(sys.argv[1])
from comfy.cli_args import args
args.cpu = True
import nodes, comfy.model_patcher, server  # noqa: F401  (main.py has them before custom nodes load)
from comfy_config import config_parser  # noqa: F401  (ComfyUI's, imported by the first pack with a pyproject.toml)
before = set(sys.modules)
start = time.perf_counter()
load = nodes.load_custom_node(pack)
loaded = asyncio.run(load) if asyncio.iscoroutine(load) else load
seconds = time.perf_counter() - start
files = sorted({os.path.realpath(m.__file__) for n, m in list(sys.modules.items())
                if n not in before and getattr(m, "__file__", None)})
own = {os.path.relpath(f, pack): sum(1 for _ in open(f, encoding="utf-8")) for f in files if f.startswith(pack + os.sep)}
print("RESULT " + json.dumps({"loaded": bool(loaded), "seconds": seconds, "modules": own}))
"""


def measure(pack: Path, warm: bool) -> dict:
    """One start; ``warm`` reads and writes the pack's bytecode cache, cold runs never write one (their copy of the
    pack has none, so every source is compiled, as on a first start)."""
    env = dict(os.environ)
    if warm:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    # cwd: ComfyUI's folder, which python -c puts first on the path, as "python main.py" run there
    done = subprocess.run([sys.executable, "-c", MEASURE, str(pack)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=os.environ["COMFYUI_PATH"])
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"startup_imports: error: measuring {pack} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def extract(rev: str, dest: Path) -> Path:
    archive = dest.with_suffix(".tar")
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), rev], check=True)
    pack = dest / "minimax-hotfix"
    with tarfile.open(archive) as tar:
        tar.extractall(pack, filter="data")
    return pack


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="0033aee", help="the earlier commit to compare with (default: %(default)s)")
    parser.add_argument("--after", default="HEAD", help="the commit to measure (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if not os.environ.get("COMFYUI_PATH"):
        parser.error("set COMFYUI_PATH to a ComfyUI checkout and run with that ComfyUI's python")
    with tempfile.TemporaryDirectory() as tmp:
        labels = (f"before ({args.before})", f"after ({args.after})")
        packs = {(label, mode): extract(rev, Path(tmp) / f"{index}-{mode}")
                 for index, (label, rev) in enumerate(zip(labels, (args.before, args.after), strict=True))
                 for mode in ("cold", "warm")}
        runs = {key: [] for key in packs}
        for (_, mode), pack in packs.items():
            if mode == "warm":
                measure(pack, warm=True)  # writes the bytecode cache the warm runs read
        for _ in range(args.repeats):
            for (label, mode), results in runs.items():
                results.append(measure(packs[(label, mode)], warm=mode == "warm"))
    for label in labels:
        modules = runs[(label, "warm")][-1]["modules"]
        print(f"{label}: modules={len(modules)} lines={sum(modules.values())}")
        for name, lines in sorted(modules.items()):
            print(f"    {name:45s} {lines:5d}")
    medians = {key: statistics.median(r["seconds"] for r in results) for key, results in runs.items()}
    for (label, mode), results in runs.items():
        seconds = [r["seconds"] * 1000 for r in results]
        print(f"{label} {mode}: loaded={all(r['loaded'] for r in results)} load_custom_node median "
              f"{medians[(label, mode)] * 1000:.1f} ms (min {min(seconds):.1f}, max {max(seconds):.1f}, n={len(seconds)})")
    before, after = labels
    lines = [sum(runs[(label, "warm")][-1]["modules"].values()) for label in labels]
    print(f"ratio after/before: lines {lines[1] / lines[0]:.2f}, import time cold "
          f"{medians[(after, 'cold')] / medians[(before, 'cold')]:.2f}, warm "
          f"{medians[(after, 'warm')] / medians[(before, 'warm')]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
