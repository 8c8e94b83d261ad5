"""The pack loaded the way ComfyUI loads a custom node folder (needs COMFYUI_PATH)."""

import asyncio
import logging
import sys
import types
from pathlib import Path

import pytest
import torch
from counting_fix import CountingFix, tiny_model
from patchers import ComfyBackend

from minimax_hotfix import registry

ROOT = Path(__file__).resolve().parents[1]
NODE_IDS = {
    "MiniMaxHotfixVAELoader": "VAELoader",
    "MiniMaxHotfixCLIPLoader": "CLIPLoader",
    "MiniMaxHotfixUNETLoader": "UNETLoader",
    "MiniMaxHotfixApplyVAE": None,
    "MiniMaxHotfixApplyCLIP": None,
    "MiniMaxHotfixApplyModel": None,
    "MiniMaxHotfixStatus": None,
}


@pytest.fixture(scope="module")
def comfy_nodes(comfyui):
    """ComfyUI's node registry with the pack loaded into it; the pack's process-wide fixes are uninstalled after,
    so they do not leak into other tests' red controls."""
    import nodes

    stock = set(nodes.NODE_CLASS_MAPPINGS)
    assert asyncio.run(nodes.load_custom_node(str(ROOT), ignore=stock)), "ComfyUI failed to load the pack"
    yield nodes
    pack_registry(nodes).uninstall_process_fixes()


def pack_registry(nodes):
    """The registry of the pack as ComfyUI loaded it (a module tree of its own, not minimax_hotfix)."""
    return sys.modules[nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixStatus"].__module__].registry


@pytest.fixture
def counting_fix(comfy_nodes, registry):
    """A test fix in the registry of the pack as ComfyUI loaded it."""
    fix = CountingFix()
    fix.targets = ("vae", "clip", "model")
    registry(fix, registry=pack_registry(comfy_nodes))
    return fix


def test_every_node_registers(comfy_nodes):
    assert set(NODE_IDS) <= set(comfy_nodes.NODE_CLASS_MAPPINGS)
    assert all(comfy_nodes.NODE_DISPLAY_NAME_MAPPINGS.get(node_id) for node_id in NODE_IDS)


@pytest.mark.parametrize("ours,stock", [(k, v) for k, v in NODE_IDS.items() if v])
def test_loader_interface_equals_the_stock_loader(comfy_nodes, ours, stock):
    ours, stock = comfy_nodes.NODE_CLASS_MAPPINGS[ours], comfy_nodes.NODE_CLASS_MAPPINGS[stock]
    assert ours.INPUT_TYPES() == stock.INPUT_TYPES()
    for attribute in ("RETURN_TYPES", "FUNCTION", "OUTPUT_NODE"):
        assert getattr(ours, attribute, None) == getattr(stock, attribute, None), attribute
    assert ours.__mro__[1] is stock


def test_the_unet_loader_loads_like_stock_then_attaches(comfy_nodes, counting_fix, monkeypatch):
    import comfy.sd
    import folder_paths

    loaded = ComfyBackend().patcher(tiny_model())
    seen = {}
    monkeypatch.setattr(folder_paths, "get_full_path_or_raise", lambda folder, name: f"/{folder}/{name}")
    monkeypatch.setattr(comfy.sd, "load_diffusion_model", lambda path, **kw: seen.update(path=path, **kw) or loaded)

    (model,) = comfy_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixUNETLoader"]().load_unet("h3.safetensors", "default")
    assert model is loaded and seen["path"] == "/diffusion_models/h3.safetensors"
    assert model.get_injections(registry.key_for(counting_fix))


def test_apply_nodes_leave_their_input_unchanged(comfy_nodes, counting_fix):
    stock = ComfyBackend().patcher(tiny_model())
    (fixed,) = comfy_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixApplyModel"]().apply(model=stock)
    key = registry.key_for(counting_fix)
    assert fixed is not stock and fixed.get_injections(key) and not stock.get_injections(key)

    class VAE:  # the slice of comfy.sd.VAE the node touches
        patcher = stock

    vae = VAE()
    (fixed_vae,) = comfy_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixApplyVAE"]().apply(vae=vae)
    assert fixed_vae.patcher.get_injections(key) and vae.patcher is stock and not stock.get_injections(key)


def test_the_status_node_reports_every_fix(comfy_nodes):
    result = comfy_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixStatus"]().report()
    (table,) = result["result"]
    assert result["ui"]["text"] == [table]
    for fix_id in registry.all_fixes():
        assert fix_id in table


def test_inside_comfyui_the_pack_is_importable_as_minimax_hotfix(comfyui):
    """Other custom nodes reach the public function by name; the pack's own copy, not a second one."""
    import subprocess

    code = (
        "import asyncio, sys\n"
        f"sys.path.insert(0, {comfyui!r})\n"
        "from comfy.cli_args import args; args.cpu = True\n"
        "import nodes\n"
        f"assert asyncio.run(nodes.load_custom_node({str(ROOT)!r}, ignore=set(nodes.NODE_CLASS_MAPPINGS)))\n"
        "import minimax_hotfix\n"
        "cls = nodes.NODE_CLASS_MAPPINGS['MiniMaxHotfixStatus']\n"
        "assert minimax_hotfix is sys.modules[cls.__module__.rsplit('.', 1)[0]]\n"
        "assert callable(minimax_hotfix.attach_to_transformers_model)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


class _NotAPatcher:
    """An object with some of a model patcher's methods (a third-party node's wrapper, say), never all."""

    def __init__(self, methods):
        for name in methods:
            setattr(self, name, lambda *args, **kwargs: None)


def not_models():
    from hypothesis import strategies as st

    partial = st.sets(st.sampled_from(["clone", "get_injections", "set_injections", "remove_injections"]),
                      max_size=3).map(_NotAPatcher)
    return st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=3), partial,
                     partial.map(lambda inner: types.SimpleNamespace(patcher=inner, clone=lambda: None)),
                     st.just(torch.zeros(2)), st.just(types.SimpleNamespace(patcher=None)))


@pytest.mark.parametrize("node_id,input_name", [("MiniMaxHotfixApplyModel", "model"), ("MiniMaxHotfixApplyCLIP", "clip"),
                                                ("MiniMaxHotfixApplyVAE", "vae")])
def test_apply_nodes_pass_on_what_is_no_comfyui_model_unchanged_with_one_log_line(comfy_nodes, node_id, input_name):
    from hypothesis import given, settings
    from workflow_fuzzing import examples

    node = comfy_nodes.NODE_CLASS_MAPPINGS[node_id]()
    logger = logging.getLogger("minimax_hotfix")

    @settings(max_examples=examples(60))
    @given(obj=not_models())
    def check(obj):
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger.addHandler(handler)
        try:
            (out,) = node.apply(**{input_name: obj})
        finally:
            logger.removeHandler(handler)
        assert out is obj
        assert [record.levelno for record in records] == [logging.WARNING]
        assert "passed on unchanged, no fix attached" in records[0].getMessage()

    check()
