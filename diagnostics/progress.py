"""Progress of the doctor's long steps on stderr, so that stdout (the table, or ``--json``'s document) stays clean.

With tqdm (ComfyUI ships it) a bar: done/total, elapsed, and what runs now; without it one plain line per item.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Iterable, Iterator, TypeVar

Item = TypeVar("Item")


def progress(items: Iterable[Item], what: str, label: Callable[[Item], str] = str, out=None) -> Iterator[Item]:
    """Yields ``items``, showing on ``out`` (default stderr) ``what``, done/total, elapsed and ``label(item)`` of the
    item running now."""
    items = list(items)
    out = out or sys.stderr
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        with tqdm(total=len(items), desc=what, file=out, unit="step", dynamic_ncols=True) as bar:
            for item in items:
                bar.set_postfix_str(label(item))
                yield item
                bar.update()
        return
    start = time.monotonic()
    for done, item in enumerate(items):
        print(f"{what}: {done + 1}/{len(items)} {label(item)} ({time.monotonic() - start:.0f} s elapsed)", file=out,
              flush=True)
        yield item
