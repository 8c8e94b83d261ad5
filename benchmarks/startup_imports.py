"""What ComfyUI's start-up imports of the pack, and how long ``load_custom_node`` takes for it, side by side with an
earlier commit of the pack, in one run.

    COMFYUI_PATH=/path/to/ComfyUI <ComfyUI's python> benchmarks/startup_imports.py [--before REV] [--repeats 7]

Each measurement is a fresh process that imports what ComfyUI's ``main.py`` has imported before custom nodes load
(``nodes``, ``comfy.model_patcher``, ``server``), then times ``nodes.load_custom_node(<pack>)`` and lists the pack's
modules that call added to ``sys.modules`` (lines counted per file). The two packs alternate, so drift of a noisy
machine hits both; medians are printed with their ratio. ``--before`` (default: 0033aee, the last commit
before the start-up redesign) is extracted with ``git archive`` into a temporary folder.
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
sys.path.insert(0, comfy); os.chdir(comfy)
from comfy.cli_args import args
args.cpu = True
import nodes, comfy.model_patcher, server  # noqa: F401  (main.py has them before custom nodes load)
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


def measure(pack: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(pack)], capture_output=True, text=True, timeout=600)
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"startup_imports: error: measuring {pack} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def extract(rev: str, dest: Path) -> Path:
    archive = dest / "pack.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), rev], check=True)
    pack = dest / "minimax-hotfix"
    with tarfile.open(archive) as tar:
        tar.extractall(pack, filter="data")
    return pack


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="0033aee", help="the earlier commit to compare with (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if not os.environ.get("COMFYUI_PATH"):
        parser.error("set COMFYUI_PATH to a ComfyUI checkout and run with that ComfyUI's python")
    with tempfile.TemporaryDirectory() as tmp:
        packs = {f"before ({args.before})": extract(args.before, Path(tmp)), "now": ROOT}
        runs = {label: [] for label in packs}
        for _ in range(args.repeats):
            for label, pack in packs.items():
                runs[label].append(measure(pack))
    summary = {}
    for label, results in runs.items():
        modules = results[-1]["modules"]
        summary[label] = (len(modules), sum(modules.values()), statistics.median(r["seconds"] for r in results))
        print(f"{label}: loaded={all(r['loaded'] for r in results)} modules={len(modules)} "
              f"lines={sum(modules.values())} load_custom_node median={summary[label][2] * 1000:.0f} ms "
              f"(min {min(r['seconds'] for r in results) * 1000:.0f}, max {max(r['seconds'] for r in results) * 1000:.0f}, "
              f"n={len(results)})")
        for name, lines in sorted(modules.items()):
            print(f"    {name:45s} {lines:5d}")
    (before, now) = summary.values()
    print(f"ratio now/before: modules {now[0] / before[0]:.2f}, lines {now[1] / before[1]:.2f}, "
          f"import time {now[2] / before[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
