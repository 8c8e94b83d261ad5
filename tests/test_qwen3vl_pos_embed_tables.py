"""qwen3vl_pos_embed's ResidentPositionTables (kernels/qwen3vl_pos_embed.py) on its own, pure torch: what one tower
keeps between calls stays right when calls overlap in two threads. The tower-level tests are in
test_qwen3vl_pos_embed_comfyui.py and test_qwen3vl_pos_embed_traffic.py (COMFYUI_PATH)."""

import threading

import pytest
import torch

from minimax_hotfix.kernels.qwen3vl_pos_embed import ResidentPositionTables

ROWS, WIDTH = 16, 2
CPU = torch.device("cpu")
WHOLE_TABLE, KEPT_RESULT = [(1, 4, 4)], [(1, 2, 2)]  # 16 patches: the whole table made resident; 4: a kept result


def table_of(tables: ResidentPositionTables, weight: torch.Tensor, grid, building=lambda: None) -> torch.Tensor:
    """One call through ``tables`` for a tower whose pos_embed weight is ``weight`` (the stamp is its first value);
    ``building()`` runs while the table or the stock result is being made."""
    patches = sum(t * h * w for t, h, w in grid)

    def made(rows):
        building()
        return weight[:rows].clone()

    return tables.table(float(weight[0, 0]), CPU, grid, ROWS, whole_table=lambda: made(ROWS),
                        stock_result=lambda: made(patches),
                        interpolate=lambda lookup: lookup(torch.arange(patches)))


@pytest.mark.parametrize("grid", [WHOLE_TABLE, KEPT_RESULT], ids=["whole table", "kept stock result"])
def test_what_a_call_built_from_the_old_weight_is_not_kept_for_the_new_one(grid):
    """A call still building from the old weight (another thread) while a call with the new weight (a LoRA patched in)
    runs: later calls with the new weight get the new weight's rows, not what the slow call finished afterwards."""
    old, new = torch.zeros(ROWS, WIDTH), torch.ones(ROWS, WIDTH)
    tables = ResidentPositionTables()
    old_building, new_returned = threading.Event(), threading.Event()

    def slow_build():
        old_building.set()
        new_returned.wait(0.5)  # the new call's turn; 0.5 s when it has to wait for this build to finish first

    slow = threading.Thread(target=table_of, args=(tables, old, grid, slow_build))
    slow.start()
    assert old_building.wait(5)
    table_of(tables, new, grid)
    new_returned.set()
    slow.join(5)
    later = table_of(tables, new, grid)
    assert torch.equal(later, torch.ones_like(later)), "the old weight's rows are kept for the new weight"


def test_dropping_one_device_keeps_the_others():
    tables = ResidentPositionTables()
    weight = torch.ones(ROWS, WIDTH)
    table_of(tables, weight, WHOLE_TABLE)
    kept = tables.resident_bytes()
    tables.drop(torch.device("meta"))
    assert kept == ROWS * WIDTH * 4 and tables.resident_bytes() == kept
    tables.drop(CPU)
    assert tables.resident_bytes() == 0
