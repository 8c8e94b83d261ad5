"""The end-to-end scenario table (tests/test_seed_scenarios_on_device.py): one row per scenario x core x budget x
loaders, printed in the test summary (conftest) so that a run's numbers can be pasted as they are. ``loader``:
ComfyUI's model loader on the device ("legacy", "dynamic": dynamic VRAM); ``vbar``: under dynamic VRAM, the MiB of
weights faulted in / found resident / refused (streamed) at the prompt's faults."""

from __future__ import annotations

ROWS: list[dict] = []
COLUMNS = ("scenario", "core", "budget", "loader", "loaders", "outcome", "loads", "hooks", "max_abs_diff", "h2d", "vbar")


def lines() -> list[str]:
    if not ROWS:
        return []
    widths = {column: max(len(column), *(len(str(row.get(column, ""))) for row in ROWS)) for column in COLUMNS}
    header = " | ".join(column.ljust(widths[column]) for column in COLUMNS)
    return [header, "-" * len(header),
            *(" | ".join(str(row.get(column, "")).ljust(widths[column]) for column in COLUMNS) for row in ROWS)]
