"""qwen3vl_pos_embed: host-to-device bytes of the position table per call, pack vs stock, at the MiniMax H3 text
encoder's sizes (ComfyUI's real tower: width 1152, 2304-row table; COMFYUI_PATH, skipped without it).

The compute device is meta (ComfyUI's ops cast CPU weights to it); every other weight is there already and only
``pos_embed``'s weight stays in CPU RAM, so what crosses is the position table's traffic alone, counted by a dispatch
mode (copies from cpu to meta). Values are checked on the CPU against the stock method (bit for bit); the end-to-end
values on a device that holds data are the simulated accelerator's (tests/test_simulated_device_*).

Goal (docs/qwen3vl_pos_embed.md): with the fix no call sends more than the stock method, and once the table is on the
device nothing crosses again while the weight is unchanged.
"""

import pytest
import torch

from minimax_hotfix import registry as pack_registry
from minimax_hotfix.benchmarks._host_to_meta import HostToMeta
from minimax_hotfix.contract import remove_handles
from minimax_hotfix.kernels.qwen3vl_pos_embed import ResidentPositionTables, interpolated_position_table
from minimax_hotfix.patches import qwen3vl_pos_embed as fix

HIDDEN, TABLE_ROWS = 1152, 2304
IMAGES = {"512x512": (1, 32, 32), "768x768": (1, 48, 48), "1024x1024": (1, 64, 64)}  # patches of 16 px
CALLS = 3


pytestmark = pytest.mark.usefixtures("comfyui", "fresh_detection")


def h3_tower(dtype=torch.float32):
    """ComfyUI's Qwen3-VL tower at the H3 text encoder's vision width, depth 0, on meta except pos_embed's weight."""
    import comfy.ops
    from comfy.text_encoders.qwen3vl import QWEN3VL_VISION, QWEN3VL_VISION_COMMON, Qwen3VLVisionModel

    config = {**QWEN3VL_VISION_COMMON, **QWEN3VL_VISION["qwen3vl_32b"], "out_hidden_size": 64, "depth": 0,
              "deepstack_visual_indexes": []}
    with torch.device("meta"):
        tower = Qwen3VLVisionModel(config, dtype=dtype, ops=comfy.ops.manual_cast)
    assert (tower.pos_embed.num_embeddings, tower.pos_embed.embedding_dim) == (TABLE_ROWS, HIDDEN)
    weight = torch.randn(TABLE_ROWS, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    tower.pos_embed.weight = torch.nn.Parameter(weight, requires_grad=False)
    return tower


def bytes_per_call(tower, grid, calls=CALLS) -> list[int]:
    patches = sum(t * h * w for t, h, w in grid)
    pixels = torch.zeros(patches, 3 * 2 * 16 * 16, device="meta")
    sent = []
    for _ in range(calls):
        with torch.inference_mode(), HostToMeta() as counter:
            tower(pixels, torch.tensor(grid))
        sent.append(counter.bytes)
    return sent


@pytest.mark.parametrize("image", list(IMAGES))
def test_bytes_per_call_never_above_stock_and_nothing_after_the_first(image):
    grid = [IMAGES[image]]
    stock = bytes_per_call(h3_tower(), grid)
    result_bytes = IMAGES[image][1] * IMAGES[image][2] * HIDDEN * 4
    assert stock == [result_bytes] * CALLS  # red: stock sends the interpolated rows on every call

    tower = h3_tower()
    handles = fix.hook_towers(tower)
    pack = bytes_per_call(tower, grid)
    remove_handles(handles)
    assert pack[0] <= stock[0], (pack, stock)  # green: never more than stock
    assert pack[0] == min(result_bytes, TABLE_ROWS * HIDDEN * 4)
    assert pack[1:] == [0] * (CALLS - 1)  # green: nothing crosses after the first call


def test_red_control_a_fix_that_keeps_nothing_resends_every_call(monkeypatch):
    """The assertion above detects per-call traffic: with the tables forgotten between calls (the pack's former
    behaviour for a large image: the whole table cast per call), the later calls send again."""
    monkeypatch.setattr(fix.FIX, "resident_tables", lambda tower: ResidentPositionTables())
    tower = h3_tower()
    handles = fix.hook_towers(tower)
    sent = bytes_per_call(tower, [IMAGES["1024x1024"]])
    remove_handles(handles)
    assert sent == [TABLE_ROWS * HIDDEN * 4] * CALLS


def test_mixed_sizes_after_the_table_is_resident_move_nothing():
    tower = h3_tower(torch.bfloat16)
    handles = fix.hook_towers(tower)
    first = bytes_per_call(tower, [IMAGES["512x512"]], calls=1)
    large = bytes_per_call(tower, [IMAGES["1024x1024"]], calls=1)
    later = [bytes_per_call(tower, [IMAGES[image]], calls=1)[0] for image in IMAGES]
    two_images = bytes_per_call(tower, [IMAGES["512x512"], (2, 16, 24)], calls=1)
    remove_handles(handles)
    assert first == [32 * 32 * HIDDEN * 2] and large == [TABLE_ROWS * HIDDEN * 2]
    assert later == [0, 0, 0] and two_images == [0]


def test_kept_small_results_never_hold_more_rows_than_the_table():
    tower = h3_tower(torch.bfloat16)
    handles = fix.hook_towers(tower)
    for side in range(10, 48, 6):  # 7 image sizes, each under the table's 2304 patches, 6500 together
        bytes_per_call(tower, [(1, side, side)], calls=1)
    kept = fix.FIX.resident_tables(tower).resident_bytes()
    remove_handles(handles)
    assert 0 < kept <= TABLE_ROWS * HIDDEN * 2


def test_weight_changes_rebuild_the_table():
    """A new weight object (ComfyUI's weight patching replaces the parameter), an in-place write, or another patch set
    (a LoRA: a new uuid on the model) each make the next call fetch the table again; nothing else does."""
    holder = torch.nn.Module()
    holder.visual = tower = h3_tower()
    handles = fix.hook_towers(holder)
    large = [IMAGES["1024x1024"]]
    table = TABLE_ROWS * HIDDEN * 4
    sent = bytes_per_call(tower, large, calls=2)
    tower.pos_embed.weight = torch.nn.Parameter(tower.pos_embed.weight.detach() + 1, requires_grad=False)
    sent += bytes_per_call(tower, large, calls=2)
    with torch.no_grad():
        tower.pos_embed.weight.mul_(2)
    sent += bytes_per_call(tower, large, calls=2)
    holder.current_weight_patches_uuid = "another LoRA"
    sent += bytes_per_call(tower, large, calls=2)
    remove_handles(handles)
    assert sent == [table, 0] * 4


def test_unload_frees_the_table_and_a_stock_loader_model_is_untouched():
    import comfy.model_patcher

    holder = torch.nn.Module()
    holder.visual = h3_tower()
    patcher = comfy.model_patcher.ModelPatcher(holder, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    stock_holder = torch.nn.Module()
    stock_holder.visual = h3_tower()
    stock_patcher = comfy.model_patcher.ModelPatcher(stock_holder, load_device=torch.device("cpu"),
                                                     offload_device=torch.device("cpu"))
    assert "qwen3vl_pos_embed" in pack_registry.attach_fixes(patcher, "clip")
    large = [IMAGES["1024x1024"]]
    sent = []
    for _ in range(2):  # two prompts: ComfyUI ejects and re-injects around every load
        patcher.inject_model()
        stock_patcher.inject_model()
        sent += bytes_per_call(holder.visual, large, calls=1)
        patcher.eject_model()
        stock_patcher.eject_model()
    assert sent == [TABLE_ROWS * HIDDEN * 4, 0]
    assert fix.FIX.resident_tables(holder.visual).resident_bytes() == TABLE_ROWS * HIDDEN * 4
    assert "fast_pos_embed_interpolate" not in vars(stock_holder.visual) and not stock_patcher.get_all_callbacks(
        "on_detach_after")
    patcher.detach(unpatch_all=False)  # load_models_gpu before every reload: weights stay, and so does the table
    assert fix.FIX.resident_tables(holder.visual).resident_bytes() == TABLE_ROWS * HIDDEN * 4
    patcher.unpatch_model = lambda *args, **kwargs: None  # meta holds no data to move back to the CPU
    patcher.detach(unpatch_all=True)  # ComfyUI unloading it (model_unload)
    assert fix.FIX.resident_tables(holder.visual).resident_bytes() == 0  # no memory kept across the unload
    del patcher.unpatch_model
    patcher.inject_model()
    assert bytes_per_call(holder.visual, large, calls=1) == [TABLE_ROWS * HIDDEN * 4]  # reloaded: fetched again
    pack_registry.detach_fixes(patcher, "clip")
    assert fix.FIX.resident_tables(holder.visual).resident_bytes() == 0


@pytest.mark.parametrize(("dtype", "grid"), [(torch.float32, ((1, 64, 64),)), (torch.bfloat16, ((1, 32, 32),)),
                                             (torch.float16, ((1, 4, 6), (2, 2, 2), (3, 10, 14)))])
def test_both_kept_forms_equal_the_stock_method_bit_for_bit(dtype, grid):
    """Values: the resident-table interpolation and the kept stock result, on one device, against the stock method
    (the fault-free reference) of a random H3-sized table."""
    import comfy.ops
    from comfy.text_encoders.qwen3vl import QWEN3VL_VISION, QWEN3VL_VISION_COMMON, Qwen3VLVisionModel

    config = {**QWEN3VL_VISION_COMMON, **QWEN3VL_VISION["qwen3vl_32b"], "out_hidden_size": 64, "depth": 0,
              "deepstack_visual_indexes": []}
    tower = Qwen3VLVisionModel(config, dtype=dtype, ops=comfy.ops.manual_cast)
    torch.nn.init.normal_(tower.pos_embed.weight, generator=torch.Generator().manual_seed(1))
    grid_thw = torch.tensor(grid)
    reference = tower.fast_pos_embed_interpolate(grid_thw)
    cpu = torch.device("cpu")
    embedding = tower.pos_embed

    def through(tables, rows):
        return tables.table("weights", cpu, list(grid), rows,
                            whole_table=lambda: embedding(torch.arange(TABLE_ROWS)),
                            stock_result=lambda: tower.fast_pos_embed_interpolate(grid_thw),
                            interpolate=lambda lookup: interpolated_position_table(
                                lookup, list(grid), tower.num_grid_per_side, tower.spatial_merge_size, dtype, cpu))

    table_form, kept_form = ResidentPositionTables(), ResidentPositionTables()
    for _ in range(2):  # made, then reused
        assert torch.equal(through(table_form, rows=1), reference)  # 1 row: any grid makes the table resident
        assert torch.equal(through(kept_form, rows=10**9), reference)  # never resident: the kept stock result
    assert table_form._tables and not kept_form._tables
