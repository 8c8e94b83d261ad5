"""Hypothesis set-up and workflow strategies shared by the fuzz tests of the swap tool (tests/test_swap_loaders_fuzz.py)
and of its route in a real ComfyUI (tests/test_workflows.py).

The profile "ci" (the default) is reproducible: derandomized (the same examples on every run), no example database,
no deadline (2 shared CI cores are slow at times). HYPOTHESIS_PROFILE=explore draws new random examples and ten
times as many: a failure it finds is kept as an explicit regression case in the test file.

Seeds of the mutations: the bundled workflows (as shipped and back on stock loaders), every official MiniMax template
of comfyui-workflow-templates-json (as shipped and swapped, for the reverse), the two Music 3 user workflows and the
workflows of tests/frontend_workflows (as they are and swapped), the bundled workflows in API format, and workflows
drawn from the frontend's own workflow schema (``frontend_workflows``).
"""

from __future__ import annotations

import copy
import json
import os
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

PACK_ROOT = Path(__file__).resolve().parents[2]
from hotfix_testing.user_workflows import music3_checkpoint, music3_gguf
from hotfix_testing.workflow_api import TEMPLATES, load, ui_to_api
from minimax_hotfix import swap_loaders

settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("explore", parent=settings.get_profile("ci"), derandomize=False, max_examples=10_000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The fuzz of code that does not use ComfyUI (the swap tool, the doctor's inputs) runs once in CI, in the run without
# ComfyUI: the run with ComfyUI would only repeat the same examples.
without_comfyui_only = pytest.mark.skipif(bool(os.environ.get("COMFYUI_PATH")),
                                          reason="ComfyUI-independent fuzz: runs in the run without ComfyUI")


def examples(count: int) -> int:
    """``count`` examples in CI; ten times as many under HYPOTHESIS_PROFILE=explore."""
    return count * (10 if os.environ.get("HYPOTHESIS_PROFILE") == "explore" else 1)


MINIMAX_NODE_PREFIXES = ("MiniMaxH3", "EmptyMiniMax", "MiniMaxMusic3")
BUNDLED = sorted((PACK_ROOT / "workflows").glob("*.json"))
FRONTEND_ACCEPTS = sorted((PACK_ROOT / "tests" / "frontend_workflows").glob("*.json"))  # real workflows (issue 31)


@cache
def minimax_templates() -> tuple[tuple[str, str], ...]:
    """(name, text) of every UI-format template whose name says MiniMax or that uses a MiniMax node, at any depth."""
    found = []
    for entry in sorted(TEMPLATES.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        text = entry.read_text(encoding="utf-8")
        doc = json.loads(text)
        if not isinstance(doc, dict) or "nodes" not in doc:
            continue
        types = {node["type"] for node in swap_loaders.ui_nodes(doc)}
        if "minimax" in entry.name.lower() or any(t.startswith(MINIMAX_NODE_PREFIXES) for t in types):
            found.append((entry.name, text))
    return tuple(found)


def _swapped(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    swap_loaders.swap(doc)
    return doc


def _stock(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    swap_loaders.swap(doc, reverse=True)
    return doc


@cache
def ui_seeds() -> tuple[dict, ...]:
    templates = [json.loads(text) for _, text in minimax_templates()]
    bundled = [load(path) for path in BUNDLED]
    users = [music3_gguf(), music3_checkpoint()] + [load(path) for path in FRONTEND_ACCEPTS]
    return tuple(templates + [_swapped(doc) for doc in templates] + bundled + [_stock(doc) for doc in bundled]
                 + users + [_swapped(doc) for doc in users])


@cache
def api_seeds() -> tuple[dict, ...]:
    specs = load(PACK_ROOT / "tests" / "workflow_node_specs.json")["nodes"]
    prompts = [ui_to_api(load(path), specs) for path in BUNDLED]
    return tuple(prompts + [_stock(doc) for doc in prompts])


# Keys the tool reads: a mutation puts them where they matter more often than chance would.
KEYS = ["id", "type", "nodes", "links", "inputs", "outputs", "properties", "definitions", "subgraphs", "link",
        "state", "lastNodeId", "lastLinkId", "last_node_id", "last_link_id", "class_type", "_meta", "extra",
        "groupNodes", "origin_id", "origin_slot", "target_id", "target_slot", "pos", "size", "ver", "cnr_id",
        swap_loaders.INSERTED_KEY, swap_loaders.ORIGINAL_KEY, "after", "counters", "widgets_values", "graph", "node"]
NODE_TYPES = [*swap_loaders.STOCK_TO_PACK, *swap_loaders.PACK_TO_STOCK, *swap_loaders.APPLY_TYPES,
              *swap_loaders.API_LOADER_OUTPUTS, "KSampler", "Reroute", "MiniMaxHotfixStatus", "VAEDecode"]
IO_TYPES = ["MODEL", "CLIP", "VAE", "IMAGE", "LATENT", "*"]

scalars = (st.none() | st.booleans() | st.integers(-3, 40) | st.integers() | st.floats(allow_nan=False)
           | st.sampled_from(KEYS + NODE_TYPES + IO_TYPES) | st.text(max_size=6))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4),
                                                                          inner, max_size=5),
    max_leaves=12)


def _slots(doc) -> list:
    """(container, key, whether it is one the tool reads) of every value in ``doc``, without recursion. The tool
    reads the values of ``KEYS`` and each element of a list held by one: one node, one link, one slot (in the large
    workflows drawn from the frontend's schema, a value picked at random is most often a position or a widget)."""
    found, pending = [], [(doc, None)]
    while pending:
        container, name = pending.pop()
        keys = list(container) if isinstance(container, dict) else range(len(container))
        for key in keys:
            found.append((container, key, (key if isinstance(container, dict) else name) in KEYS))
            if isinstance(container[key], (dict, list)):
                pending.append((container[key], key))
    return found


def _deep(depth: int):
    value = []
    for _ in range(depth):
        value = [value]
    return value


MUTATIONS = ("replace", "delete", "truncate", "wrap in a list", "wrap in an object", "to a string", "null",
             "duplicate", "deepen")


@st.composite
def mutated(draw, seeds):
    """A document of ``seeds`` (a strategy) with one to three ordinary damages: a field of another type, a key
    missing, a list cut short, an element duplicated, a value nested deep (up to past the tool's limit)."""
    doc = copy.deepcopy(draw(seeds))
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(doc)
        if not slots:
            break
        interesting = [(container, key) for container, key, read in slots if read]
        slots = [(container, key) for container, key, _ in slots]
        container, key = draw(st.sampled_from(interesting if interesting and draw(st.booleans()) else slots))
        value = container[key]
        mutation = draw(st.sampled_from(MUTATIONS))
        if mutation == "replace":
            container[key] = draw(json_values)
        elif mutation == "delete":
            del container[key]
        elif mutation == "truncate" and isinstance(value, (list, str)):
            container[key] = value[:draw(st.integers(0, max(0, len(value) - 1)))]
        elif mutation == "wrap in a list":
            container[key] = [value]
        elif mutation == "wrap in an object":
            container[key] = {draw(st.sampled_from(KEYS)): value}
        elif mutation == "to a string":
            container[key] = json.dumps(value)[:12]
        elif mutation == "null":
            container[key] = None
        elif mutation == "duplicate" and isinstance(value, list) and value:
            value.append(copy.deepcopy(draw(st.sampled_from(value))))
        elif mutation == "deepen":
            container[key] = _deep(draw(st.sampled_from([5, 150, swap_loaders.MAX_DEPTH, 400])))
    return doc


@st.composite
def generated_ui(draw):
    """A small UI workflow drawn from scratch: loaders, consumers and links that agree or not, subgraphs and id
    counters sometimes."""
    nodes = []
    for node_id in draw(st.lists(st.integers(1, 12), unique=True, max_size=6)):
        node = {"id": node_id, "type": draw(st.sampled_from(NODE_TYPES))}
        if draw(st.booleans()):
            node["outputs"] = [{"type": draw(st.sampled_from(IO_TYPES)), "links": draw(st.lists(st.integers(1, 9),
                                                                                              max_size=3))}]
        if draw(st.booleans()):
            node["inputs"] = [{"type": draw(st.sampled_from(IO_TYPES)), "link": draw(st.none() | st.integers(1, 9))}]
        if draw(st.booleans()):
            node["properties"] = draw(st.dictionaries(st.sampled_from(KEYS), scalars, max_size=3))
        nodes.append(node)
    ids = [node["id"] for node in nodes] or [1]
    links = [[link_id, draw(st.sampled_from(ids)), draw(st.integers(0, 1)), draw(st.sampled_from(ids)), 0,
              draw(st.sampled_from(IO_TYPES))] for link_id in draw(st.lists(st.integers(1, 9), unique=True,
                                                                            max_size=5))]
    doc = {"nodes": nodes, "links": links}
    if draw(st.booleans()):
        doc["last_node_id"], doc["last_link_id"] = max(ids), 9
    if draw(st.booleans()):
        doc["definitions"] = {"subgraphs": [draw(generated_subgraph())]}
    return doc


@st.composite
def generated_subgraph(draw):
    nodes = [{"id": 20 + index, "type": draw(st.sampled_from(NODE_TYPES)),
              "outputs": [{"type": draw(st.sampled_from(IO_TYPES)), "links": [30 + index]}]} for index in range(2)]
    links = [{"id": 30 + index, "origin_id": 20 + index, "origin_slot": 0, "target_id": draw(st.sampled_from([-20, 21])),
              "target_slot": 0, "type": "CLIP"} for index in range(draw(st.integers(0, 2)))]
    return {"id": draw(st.sampled_from(["sub-1", "sub-2"])), "nodes": nodes, "links": links,
            "state": {"lastNodeId": 22, "lastLinkId": 32}}


# ---- workflows ComfyUI's frontend accepts, drawn from its schema ----
#
# The frontend checks every workflow it opens against the zod schema of ComfyUI_frontend's
# src/platform/workflow/validation/schemas/workflowSchema.ts (comfyui-frontend-package 1.49.6, the one ComfyUI 0.33.0
# pins). The strategies below draw each field in every form that schema takes: node ids as integers or strings
# (zNodeId), link ids as any number, slot numbers as strings (zSlotIndex), slot and link types as strings,
# comma-joined strings, lists or numbers (zDataType), positions as pairs or {"0", "1"} objects (zVector2), null where
# the schema says .nullable(), widget values as a list or an object (zWidgetValues), keys the schema does not name
# (.passthrough()), schema 0.4 (links as arrays, legacy group nodes) and 1 (links as objects, ``state``). The links
# agree with the nodes' slots, as the link fixer that the frontend runs after the schema (fixBadLinks) leaves them;
# node and link ids are unique across the root graph and its subgraphs, which share one id space in the frontend.
# Every strategy is built once: Hypothesis checks each new strategy object on its first draw, which would cost more
# than the drawing.

FRONTEND_IO_TYPES = ["MODEL", "CLIP", "VAE", "IMAGE", "LATENT", "INT", "*"]
# Interfaces of the node types whose outputs the swap acts on; the other types get random slots.
FRONTEND_INTERFACES = {
    "VAELoader": ([], ["VAE"]), "CLIPLoader": ([], ["CLIP"]), "UNETLoader": ([], ["MODEL"]),
    **{loader: ([], outputs) for loader, outputs in swap_loaders.API_LOADER_OUTPUTS.items()},
    "LoraLoader": (["MODEL", "CLIP"], ["MODEL", "CLIP"]),
    "VHS_VideoCombine": (["IMAGE", "VAE", "COMBO"], ["VHS_FILENAMES"]),
}
FRONTEND_NODE_TYPES = [*FRONTEND_INTERFACES, "KSampler", "VAEDecode", "Reroute", "PrimitiveNode", "Note",
                       "rgthree.Context"]
UNKNOWN_KEYS = ["label", "localized_name", "shape", "title", "widget_ue_connectable", "VHS_latentpreview", "x-user"]
SUBGRAPH_INPUT_NODE, SUBGRAPH_OUTPUT_NODE = -10, -20

small_numbers = st.integers(-2000, 2000) | st.floats(-2000, 2000, allow_nan=False)
leaf_values = st.none() | st.booleans() | small_numbers | st.text(max_size=8)
vectors = (st.tuples(small_numbers, small_numbers).map(list)
           | st.builds(lambda x, y: {"0": x, "1": y}, small_numbers, small_numbers))
boundings = st.lists(small_numbers, min_size=4, max_size=4)
uuids = st.uuids().map(str)
io_types = st.sampled_from(FRONTEND_IO_TYPES)
unknown_keys = st.dictionaries(st.sampled_from(UNKNOWN_KEYS), leaf_values, max_size=2)
flags = st.fixed_dictionaries({}, optional={"collapsed": st.booleans(), "pinned": st.booleans()})
properties = st.fixed_dictionaries({}, optional={  # zProperties; "Node name for S&R" is added per node type
    "cnr_id": st.sampled_from(["comfy-core", "comfy-core", "comfyui-videohelpersuite", "comfyui-gguf"]),
    "aux_id": st.just("city96/ComfyUI-GGUF"),
    "ver": st.sampled_from(["0.3.65", "0.3.65", "0.3.66", "v1.7.4", "unknown", "b1e9c2d"]),
    "models": st.lists(st.fixed_dictionaries(
        {"name": st.just("m.safetensors"), "url": st.just("https://huggingface.co/x/y/m.safetensors"),
         "directory": st.just("vae")}, optional={"hash": st.just("ab12"), "hash_type": st.just("SHA256")}),
        max_size=1),
})
node_extras = st.fixed_dictionaries({}, optional={
    "widgets_values": st.lists(leaf_values, max_size=3) | st.dictionaries(st.text(max_size=6), leaf_values, max_size=3),
    "color": st.just("#322"), "bgcolor": st.just("#533")})
extras = st.none() | st.fixed_dictionaries({}, optional={  # zExtra
    "ds": st.fixed_dictionaries({"scale": small_numbers, "offset": vectors}),
    "frontendVersion": st.just("1.49.6"), "workflowRendererVersion": st.sampled_from(["LG", "Vue"])})
root_extras = st.fixed_dictionaries({}, optional={
    "groups": st.lists(st.fixed_dictionaries({"title": st.text(max_size=8), "bounding": boundings},
                                             optional={"id": st.integers(1, 9)}), max_size=1),
    "config": st.none() | st.just({}) | st.just({"links_ontop": False}),
    "models": st.just([{"name": "m.safetensors", "url": "https://example.com/m.safetensors", "directory": "vae"}])})
root_ids = st.fixed_dictionaries({}, optional={"id": uuids, "revision": small_numbers})


@cache
def _indices(count: int):
    return st.integers(0, count - 1)


def _pick(draw, choices: list):
    """One of ``choices``, which depend on values drawn before (a new sampled_from would be a new strategy)."""
    return choices[draw(_indices(len(choices)))]


def _with_unknown_keys(draw, named: dict) -> dict:
    """``named`` with up to two keys the schema does not name, which .passthrough() keeps."""
    return {**named, **{key: value for key, value in draw(unknown_keys).items() if key not in named}}


def _node_id(draw, number: int):
    """zNodeId: an integer (JSON ``3`` or ``3.0``) or a string, such as the group node's ``"3:0"``."""
    return _pick(draw, [number, number, str(number), float(number), f"{number}:0"])


def _link_id(draw, number: int):
    """Link ids are z.number(): fractions too."""
    return _pick(draw, [number, number, float(number), number + 0.5])


def _slot(draw, index: int):
    """zSlotIndex: an integer or a string parseInt reads."""
    return _pick(draw, [index, index, str(index), float(index), f"{index} "])


def _data_type(draw, io_type: str):
    """zDataType: a string, a comma-joined string, a list of strings or a number. "COMBO" stands for a widget
    input typed by its option list (VHS_VideoCombine's ``format``, a converted combo of the legacy frontend)."""
    if io_type == "COMBO":
        return ["image/gif", "image/webp", "video/h264-mp4"][:draw(_indices(3)) + 1]
    other = draw(io_types)
    return _pick(draw, [io_type, io_type, io_type, f"{io_type},{other}", [io_type, other], [io_type], 7])


class _FreshIds:
    """Fresh ids, increasing with gaps, for one id space."""

    def __init__(self, draw):
        self.draw, self.last = draw, 0

    def __call__(self) -> int:
        self.last += self.draw(_indices(4)) + 1
        return self.last


def _node(draw, node_id, node_type: str, inputs, outputs, group_index=None) -> dict:
    """zComfyNode with the given slot lists (None: no "inputs"/"outputs" key); a legacy group node's inner node
    (``group_index``) has an ``index`` instead of an id, and may lack a type."""
    node = {} if group_index is not None else {"id": node_id}
    if group_index is None or draw(_indices(4)):
        node["type"] = node_type
    node.update({"pos": draw(vectors), "size": draw(vectors), "flags": draw(flags), "order": draw(small_numbers),
                 "mode": _pick(draw, [0, 0, 2, 4])})
    if inputs is not None:
        node["inputs"] = inputs
    if outputs is not None:
        node["outputs"] = outputs
    node["properties"] = draw(properties)
    if draw(st.booleans()):
        node["properties"]["Node name for S&R"] = _pick(draw, [node_type, node_type, "other"])
    node.update(draw(node_extras))
    if group_index is not None:
        node["index"] = group_index
    return _with_unknown_keys(draw, node)


def _graph(draw, node_ids: _FreshIds, link_ids: _FreshIds, instances: dict, arrays: bool, io=None):
    """(nodes, links, io link ids) of one graph. ``instances``: {subgraph id: (input types, output types)} of the
    subgraphs it may place; ``arrays``: links as schema 0.4's arrays, else objects; ``io``: (input types, output
    types) of a subgraph, whose input node (-10) feeds inner nodes and whose output node (-20) takes one link a slot.
    """
    specs = []  # [id, type, [[io type, link id]], [[io type, [link ids]]]]
    node_types = FRONTEND_NODE_TYPES + sorted(instances)
    for _ in range(draw(_indices(6)) + 1):
        node_type = _pick(draw, node_types)
        in_types, out_types = instances.get(node_type) or FRONTEND_INTERFACES.get(node_type) or (
            [draw(io_types) for _ in range(draw(_indices(4)))], [draw(io_types) for _ in range(draw(_indices(3)))])
        specs.append([_node_id(draw, node_ids()), node_type, [[t, None] for t in in_types],
                      [[t, []] for t in out_types]])
    in_io, out_io = io or ([], [])
    origins = [(spec, slot) for spec in specs for slot in range(len(spec[3]))]
    origins += [(SUBGRAPH_INPUT_NODE, slot) for slot in range(len(in_io))]
    targets = [(spec, slot) for spec in specs for slot in range(len(spec[2]))]
    targets += [(SUBGRAPH_OUTPUT_NODE, slot) for slot in range(len(out_io))]
    links, io_links = [], {("in", slot): [] for slot in range(len(in_io))}
    for target, target_slot in targets:
        candidates = [(origin, slot) for origin, slot in origins if origin is not target]
        if not candidates or not draw(st.booleans()):
            continue
        origin, origin_slot = _pick(draw, candidates)
        link_id = _link_id(draw, link_ids())
        if origin == SUBGRAPH_INPUT_NODE:
            io_type, origin_id = in_io[origin_slot], origin
            io_links[("in", origin_slot)].append(link_id)
        else:
            io_type, origin_id = origin[3][origin_slot][0], origin[0]
            origin[3][origin_slot][1].append(link_id)
        if target == SUBGRAPH_OUTPUT_NODE:
            target_id = target
            io_links[("out", target_slot)] = [link_id]
        else:
            target_id = target[0]
            target[2][target_slot][1] = link_id
        values = [link_id, origin_id, _slot(draw, origin_slot), target_id, _slot(draw, target_slot),
                  _data_type(draw, io_type)]
        if arrays:
            links.append(values)
        else:
            link = dict(zip(("id", "origin_id", "origin_slot", "target_id", "target_slot", "type"), values,
                            strict=True))
            links.append(_with_unknown_keys(draw, link))
    nodes = []
    for node_id, node_type, inputs, outputs in specs:
        input_slots = []
        for index, (io_type, link) in enumerate(inputs):
            slot = {"name": f"in{index}", "type": _data_type(draw, io_type)}
            if link is not None or draw(st.booleans()):
                slot["link"] = link
            if draw(st.booleans()):
                slot["slot_index"] = _slot(draw, index)
            if io_type == "COMBO" or draw(st.booleans()):
                slot["widget"] = {"name": f"in{index}"}
            input_slots.append(_with_unknown_keys(draw, slot))
        output_slots = []
        for index, (io_type, link_list) in enumerate(outputs):
            slot = {"name": f"out{index}", "type": _data_type(draw, io_type)}
            slot.update({"links": link_list} if link_list else _pick(draw, [{}, {"links": None}, {"links": []}]))
            if draw(st.booleans()):
                slot["slot_index"] = _slot(draw, index)
            output_slots.append(slot)
        nodes.append(_node(draw, node_id, node_type, input_slots if input_slots or draw(st.booleans()) else None,
                           output_slots if output_slots or draw(st.booleans()) else None))
    return nodes, links, io_links


def _counter(draw, last: int):
    """A last-id counter: usually the last id given, at times another number (the schema asks for no more)."""
    return _pick(draw, [last, last, last + 3, float(last), draw(small_numbers)])


def _state(draw, node_ids: _FreshIds, link_ids: _FreshIds) -> dict:
    return {"lastGroupId": draw(small_numbers), "lastNodeId": _counter(draw, node_ids.last),
            "lastLinkId": _counter(draw, link_ids.last), "lastRerouteId": draw(small_numbers)}


def _subgraph(draw, node_ids: _FreshIds, link_ids: _FreshIds, instances: dict):
    """(definition, (input types, output types)) of a subgraph (zSubgraphDefinition)."""
    in_io = [draw(io_types) for _ in range(draw(_indices(3)))]
    out_io = [draw(io_types) for _ in range(draw(_indices(3)))]
    nodes, links, io_links = _graph(draw, node_ids, link_ids, instances, arrays=False, io=(in_io, out_io))

    def io_slots(kind, types):
        return [{"id": draw(uuids), "name": f"{kind}{index}", "type": io_type,
                 "linkIds": io_links.get((kind, index), []), "localized_name": f"{kind}{index}"}
                for index, io_type in enumerate(types)]

    definition = {"id": draw(uuids), "version": 1, "state": _state(draw, node_ids, link_ids),
                  "revision": draw(small_numbers), "config": {}, "name": draw(st.text(max_size=10)),
                  "inputNode": {"id": SUBGRAPH_INPUT_NODE, "bounding": draw(boundings)},
                  "outputNode": {"id": SUBGRAPH_OUTPUT_NODE, "bounding": draw(boundings)},
                  "inputs": io_slots("in", in_io), "outputs": io_slots("out", out_io), "widgets": [],
                  "nodes": nodes, "groups": [], "links": links, "extra": {}}
    return definition, (in_io, out_io)


def _group_nodes(draw) -> dict:
    """extra.groupNodes of schema 0.4 (a legacy group node's definition, which the frontend turns into a subgraph):
    inner nodes with an index, links between them by index."""
    inner = []
    for index in range(draw(_indices(3)) + 1):
        node_type = _pick(draw, FRONTEND_NODE_TYPES)
        in_types, out_types = FRONTEND_INTERFACES.get(node_type, ([], ["MODEL"]))
        inputs = [{"name": f"in{slot}", "type": _data_type(draw, t), "link": None} for slot, t in enumerate(in_types)]
        outputs = [{"name": f"out{slot}", "type": _data_type(draw, t), "links": None}
                   for slot, t in enumerate(out_types)]
        inner.append(_node(draw, None, node_type, inputs, outputs, group_index=index))
    return {_pick(draw, ["loaders", "Model group"]): {"nodes": inner, "links": [], "external": []}}


@st.composite
def frontend_workflows(draw):
    """A UI-format workflow that the frontend's schema accepts (see above), schema 0.4 or 1, with subgraphs (nested,
    placed in the root graph or in another subgraph) and legacy group nodes sometimes."""
    node_ids, link_ids = _FreshIds(draw), _FreshIds(draw)
    version_1 = draw(st.booleans())
    inner, inner_io = _subgraph(draw, node_ids, link_ids, {}) if draw(st.booleans()) else (None, None)
    outer, outer_io = _subgraph(draw, node_ids, link_ids, {inner["id"]: inner_io} if inner else {}) \
        if inner or draw(st.booleans()) else (None, None)
    instances = {definition["id"]: io for definition, io in ((inner, inner_io), (outer, outer_io)) if definition}
    nodes, links, _ = _graph(draw, node_ids, link_ids, instances, arrays=not version_1)
    extra = draw(extras)
    if extra is not None:
        extra = _with_unknown_keys(draw, extra)
        if not version_1 and draw(st.booleans()):
            extra["groupNodes"] = _group_nodes(draw)
            nodes.append(_node(draw, _node_id(draw, node_ids()), f"workflow>{next(iter(extra['groupNodes']))}",
                               None, None))
    doc = draw(root_ids)
    if version_1:
        doc.update({"version": 1, "state": _state(draw, node_ids, link_ids), "nodes": nodes})
        if links or draw(st.booleans()):
            doc["links"] = links
    else:
        doc.update({"last_node_id": _node_id(draw, _pick(draw, [node_ids.last, node_ids.last + 3, 0])),
                    "last_link_id": _counter(draw, link_ids.last), "nodes": nodes, "links": links, "version": 0.4})
    if inner and outer and draw(st.booleans()):
        outer["definitions"] = {"subgraphs": [inner]}  # nested where it is used, instead of beside it
        inner = None
    subgraphs = [definition for definition in (outer, inner) if definition]
    if subgraphs:
        doc["definitions"] = {"subgraphs": subgraphs}
    doc.update(draw(root_extras))
    if extra is not None or draw(st.booleans()):
        doc["extra"] = extra
    return _with_unknown_keys(draw, doc)


def workflows():
    """Every kind of document the fuzz tests hand the tool: mutated UI and API workflows, generated UI workflows,
    workflows drawn from the frontend's schema and damaged, and arbitrary JSON."""
    return st.one_of(mutated(st.sampled_from(ui_seeds())), mutated(st.sampled_from(api_seeds())), generated_ui(),
                     mutated(frontend_workflows()), json_values, st.dictionaries(st.sampled_from(KEYS), json_values,
                                                                                  max_size=4))


def layouts():
    """How a file is written: indentation, compact or not, CRLF line ends, a UTF-8 byte order mark."""
    return st.fixed_dictionaries({"indent": st.sampled_from([None, 2, "\t"]), "crlf": st.booleans(),
                                  "bom": st.booleans()})


def file_bytes(doc, layout: dict) -> bytes:
    text = json.dumps(doc, indent=layout["indent"]) + "\n"
    if layout["crlf"]:
        text = text.replace("\n", "\r\n")
    return (b"\xef\xbb\xbf" if layout["bom"] else b"") + text.encode("utf-8")
