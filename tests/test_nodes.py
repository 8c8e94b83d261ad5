"""The pack loaded the way ComfyUI loads a custom node folder (needs COMFYUI_PATH)."""

import asyncio
import copy
import json
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from hotfix_testing.counting_fix import CountingFix, tiny_model
from hotfix_testing.patchers import ComfyBackend
from minimax_hotfix import registry

ROOT = Path(__file__).resolve().parents[1]
NODE_IDS = {
    "MiniMaxHotfixVAELoader": "VAELoader",
    "MiniMaxHotfixCLIPLoader": "CLIPLoader",
    "MiniMaxHotfixUNETLoader": "UNETLoader",
    "MiniMaxHotfixApplyVAE": None,
    "MiniMaxHotfixApplyCLIP": None,
    "MiniMaxHotfixApplyModel": None,
    "MiniMaxHotfixApplyRayActors": None,
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


def without_tooltips(input_types: dict) -> list:
    """Each input in order as (section, name, type, options other than its tooltip)."""
    return [(section, name, entry[0], {key: value for key, value in (entry[1] if len(entry) > 1 else {}).items()
                                       if key != "tooltip"})
            for section, inputs in input_types.items() for name, entry in inputs.items()]


@pytest.mark.parametrize("ours,stock", [(k, v) for k, v in NODE_IDS.items() if v])
def test_loader_interface_equals_the_stock_loader(comfy_nodes, ours, stock):
    ours, stock = comfy_nodes.NODE_CLASS_MAPPINGS[ours], comfy_nodes.NODE_CLASS_MAPPINGS[stock]
    assert without_tooltips(ours.INPUT_TYPES()) == without_tooltips(stock.INPUT_TYPES())
    for attribute in ("RETURN_TYPES", "FUNCTION", "OUTPUT_NODE"):
        assert getattr(ours, attribute, None) == getattr(stock, attribute, None), attribute
    assert ours.__mro__[1] is stock


def test_a_loader_adds_its_tooltips_only_where_the_stock_loader_has_none(comfy_nodes, monkeypatch):
    """A newer core's own tooltip is kept, and the stock loader's dicts are never changed."""
    stock_inputs = {"required": {"clip_name": (["a.safetensors"], {"tooltip": "the core's own"}),
                                 "type": (["minimax"],)},
                    "optional": {"device": (["default", "cpu"], {"advanced": True})}}
    untouched = copy.deepcopy(stock_inputs)
    monkeypatch.setattr(comfy_nodes.CLIPLoader, "INPUT_TYPES", classmethod(lambda cls: stock_inputs))

    ours = comfy_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixCLIPLoader"].INPUT_TYPES()
    assert ours["required"]["clip_name"][1] == {"tooltip": "the core's own"}
    assert ours["required"]["type"][1]["tooltip"].startswith("The kind of text encoder")
    device_options = dict(ours["optional"]["device"][1])
    assert device_options.pop("tooltip").startswith("Where the text encoder runs") and device_options == {"advanced": True}
    assert stock_inputs == untouched


@pytest.fixture(scope="module")
def served_node_info(comfy_nodes, tmp_path_factory):
    """``served_node_info(node_id)``: what ComfyUI's server answers the frontend's GET /object_info/<node_id>, from
    its own handler (node_info) in this process: a PromptServer built, never started."""
    import folder_paths
    import server
    from aiohttp.test_utils import make_mocked_request

    earlier_server = vars(server.PromptServer).get("instance")  # set by the first PromptServer built in a process
    user_directory = folder_paths.get_user_directory()
    folder_paths.set_user_directory(str(tmp_path_factory.mktemp("user")))  # the server creates it: not in the checkout
    loop = asyncio.new_event_loop()
    try:
        prompt_server = server.PromptServer(loop)
    finally:
        folder_paths.set_user_directory(user_directory)
    (handler,) = [route.handler for route in prompt_server.routes
                  if getattr(route, "method", None) == "GET" and route.path == "/object_info/{node_class}"]

    def node_info(node_id: str) -> dict:
        request = make_mocked_request("GET", f"/object_info/{node_id}", match_info={"node_class": node_id})
        return json.loads(asyncio.run(handler(request)).body)[node_id]

    yield node_info
    loop.close()
    if earlier_server is None:
        del server.PromptServer.instance
    else:
        server.PromptServer.instance = earlier_server


@pytest.mark.parametrize("node_id", NODE_IDS)
def test_the_frontend_gets_search_aliases_and_a_tooltip_on_every_input(served_node_info, node_id):
    info = served_node_info(node_id)
    assert info["search_aliases"], f"{node_id} has no search aliases"
    assert all(alias and alias.strip() == alias for alias in info["search_aliases"]), info["search_aliases"]
    untipped = [name for section in ("required", "optional") for name, entry in info["input"].get(section, {}).items()
                if not (len(entry) > 1 and entry[1].get("tooltip"))]
    assert not untipped, f"inputs without a tooltip: {untipped}"


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
    assert counting_fix.own_patchers == [model]


def test_apply_nodes_leave_their_input_unchanged(comfy_nodes, counting_fix):
    stock = ComfyBackend().patcher(tiny_model())
    (fixed,) = comfy_nodes.NODE_CLASS_MAPPINGS["MiniMaxHotfixApplyModel"]().apply(model=stock)
    key = registry.key_for(counting_fix)
    assert fixed is not stock and fixed.get_injections(key) and not stock.get_injections(key)
    # a choice made at attach time (H3's compute dtype) goes on the node's own clone, never on the cached input
    assert counting_fix.own_patchers == [fixed]

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
        "from comfy.cli_args import args; args.cpu = True\n"
        "import nodes\n"
        f"assert asyncio.run(nodes.load_custom_node({str(ROOT)!r}, ignore=set(nodes.NODE_CLASS_MAPPINGS)))\n"
        "import minimax_hotfix\n"
        "cls = nodes.NODE_CLASS_MAPPINGS['MiniMaxHotfixStatus']\n"
        "assert minimax_hotfix is sys.modules[cls.__module__.rsplit('.', 1)[0]]\n"
        "assert callable(minimax_hotfix.attach_to_transformers_model)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=comfyui)  # cwd: ComfyUI's folder, which python -c puts first on the path, as "python main.py" run there


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
                                                ("MiniMaxHotfixApplyVAE", "vae"),
                                                ("MiniMaxHotfixApplyRayActors", "ray_actors")])
def test_apply_nodes_pass_on_what_is_no_comfyui_model_unchanged_with_one_log_line(comfy_nodes, node_id, input_name):
    from hypothesis import given, settings

    from hotfix_testing.workflow_fuzzing import examples

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
