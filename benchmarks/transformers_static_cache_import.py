"""What the transformers_static_cache fix costs at pack load, against detecting transformers' bugs eagerly there.

    python benchmarks/transformers_static_cache_import.py [--rounds 5]

Each round starts fresh interpreters that first import torch and ``transformers`` (ComfyUI has both imported
before it loads custom nodes, but not ``transformers.generation.utils``), then time one of:

* guard: import the fix module, ``detect()``, ``install()``: what the pack does at load (target: well under the
  pack's 0.2 s budget), and check that transformers' generation code is still not imported;
* eager: import ``transformers.generation.utils`` and run the behavioural probes: what detecting at load would cost;
* first use: the probes alone with the generation code already imported: the one-off cost the guard moves into the
  first ``generate()`` call.

Prints the medians in milliseconds and the eager/guard ratio, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = (
    "import sys, time, torch, transformers\n"
    "import minimax_hotfix.registry, minimax_hotfix.contract\n"
)
CASES = {
    "guard": (
        "t = time.perf_counter()\n"
        "from minimax_hotfix.patches.transformers_static_cache import FIX\n"
        "FIX.detect(); FIX.install()\n"
        "elapsed = time.perf_counter() - t\n"
        "assert 'transformers.generation.utils' not in sys.modules\n"
    ),
    "eager": (
        "t = time.perf_counter()\n"
        "from minimax_hotfix.patches.transformers_static_cache import FIX\n"
        "import transformers.generation.utils; FIX.verdict()\n"
        "elapsed = time.perf_counter() - t\n"
    ),
    "first use": (
        "import transformers.generation.utils\n"
        "from minimax_hotfix.patches.transformers_static_cache import FIX\n"
        "t = time.perf_counter(); FIX.verdict(); elapsed = time.perf_counter() - t\n"
    ),
}


def run_once(case: str) -> float:
    code = PRELUDE + CASES[case] + "print(elapsed)\n"
    # the child imports the pack as the tests do: tools/minimax_hotfix (docs/testing.md, "How the tests import the pack")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd="/",
                         env={**os.environ, "PYTHONPATH": str(ROOT / "tools")})
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    times = {case: [] for case in CASES}
    for _ in range(rounds):  # interleaved, so machine load hits every case alike
        for case in CASES:
            times[case].append(run_once(case))
    median = {case: statistics.median(values) * 1000 for case, values in times.items()}
    import transformers

    print(f"transformers {transformers.__version__}, {rounds} rounds, fresh interpreter each, medians:")
    for case, ms in median.items():
        print(f"  {case:<10} {ms:9.1f} ms")
    print(f"  eager / guard = {median['eager'] / median['guard']:.0f}x")


if __name__ == "__main__":
    main()
