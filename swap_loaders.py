"""The swap: moves ComfyUI workflows onto MiniMax Hotfix's loaders, or back with ``reverse``.

Works on workflows in ComfyUI's UI format (nested subgraphs in ``definitions.subgraphs`` and legacy group nodes
included) or in API format:

* every stock ``VAELoader``, ``CLIPLoader`` and ``UNETLoader`` becomes the pack's loader of the same interface, in
  place: only the node type and the node's pack attribution (``properties``: ``cnr_id``, ``ver``,
  ``Node name for S&R``) change;
* every other node that produces a ``MODEL``, ``CLIP`` or ``VAE`` from nothing of that type (GGUF loaders,
  ``CheckpointLoaderSimple``, third-party loaders) gets the matching ``MiniMaxHotfixApply*`` node inserted after it,
  and every consumer of that output takes it from the Apply node. The inserted node carries the properties key
  ``minimax_hotfix_inserted`` (API format: in ``_meta``) so the reverse can find it. API format has no output
  types: the nodes of ``API_LOADER_OUTPUTS`` are handled, other nodes that feed a ``model``/``clip``/``vae`` input
  are named in a warning.

The reverse turns the pack's loaders back into stock ones and removes what the swap inserted; swap then reverse
gives back the original document exactly. Pack nodes the swap did not insert (an Apply or Status node placed by
hand) are kept and named.

One implementation for every caller: the command line ``tools/swap_loaders.py`` (files), the server route
``nodes/swap_route.py`` (the browser's *Fix this workflow*, loaded on its first request) and
``nodes/known_error_route.py`` (the loader tables). Standard library only: it runs with any Python 3.10+, without
ComfyUI or torch, and imports nothing of the pack. ``rules_module`` is ``web/swap_rules.js``, the rules the pack's
frontend extension uses.
"""

from __future__ import annotations

import collections
import copy
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

VERSION = "0.1.0"  # the pack version this file belongs to (pyproject.toml); a test keeps the two equal

# The one definition of the swap, shared with the frontend extension through web/swap_rules.js (--print-rules).
RULES = {
    "stock_to_pack": {
        "VAELoader": "MiniMaxHotfixVAELoader",
        "CLIPLoader": "MiniMaxHotfixCLIPLoader",
        "UNETLoader": "MiniMaxHotfixUNETLoader",
    },
    "apply_node": {  # output type -> (Apply node type, its input name)
        "MODEL": ["MiniMaxHotfixApplyModel", "model"],
        "CLIP": ["MiniMaxHotfixApplyCLIP", "clip"],
        "VAE": ["MiniMaxHotfixApplyVAE", "vae"],
        "RAY_ACTORS": ["MiniMaxHotfixApplyRayActors", "ray_actors"],  # raylight: each Ray actor's own model
    },
    "pack_node_prefix": "MiniMaxHotfix",
    "pack_cnr_id": "minimax-hotfix",
    "core_cnr_id": "comfy-core",
    "pack_version": VERSION,
    "attribution_keys": ["cnr_id", "ver", "Node name for S&R"],
    "original_key": "minimax_hotfix_original",
    "inserted_key": "minimax_hotfix_inserted",
    # Frontend-only nodes that pass a connection on; an output behind them is not a new model.
    "pass_through_types": ["Reroute", "PrimitiveNode", "GetNode", "SetNode"],
    "apply_node_size": [270, 26],
    "apply_node_gap": 30,
}
STOCK_TO_PACK = RULES["stock_to_pack"]
PACK_TO_STOCK = {pack: stock for stock, pack in STOCK_TO_PACK.items()}
APPLY_NODE = {io_type: tuple(entry) for io_type, entry in RULES["apply_node"].items()}
APPLY_TYPES = {node_type for node_type, _ in APPLY_NODE.values()}
PACK_CNR_ID = RULES["pack_cnr_id"]
CORE_CNR_ID = RULES["core_cnr_id"]
ATTRIBUTION_KEYS = tuple(RULES["attribution_keys"])
ORIGINAL_KEY = RULES["original_key"]
INSERTED_KEY = RULES["inserted_key"]

# raylight's diffusion-model loaders (multi-GPU MiniMax H3): Ray actors out, each actor with a model of its own
RAYLIGHT_LOADERS = ("RayUNETLoader", "RayGGUFLoader")
# API format carries no output types: the outputs of the loaders known to produce MODEL, CLIP or VAE (or Ray actors).
API_LOADER_OUTPUTS = {
    "CheckpointLoaderSimple": ["MODEL", "CLIP", "VAE"],
    "CheckpointLoader": ["MODEL", "CLIP", "VAE"],
    "DiffusersLoader": ["MODEL", "CLIP", "VAE"],
    "unCLIPCheckpointLoader": ["MODEL", "CLIP", "VAE", "CLIP_VISION"],
    "ImageOnlyCheckpointLoader": ["MODEL", "CLIP_VISION", "VAE"],
    "DualCLIPLoader": ["CLIP"],
    "TripleCLIPLoader": ["CLIP"],
    "QuadrupleCLIPLoader": ["CLIP"],
    # ComfyUI-GGUF: its legacy loaders, and the Dynamic VRAM ones (the loaders of MiniMax Music 3's GGUF text encoder
    # under dynamic VRAM, where its CUDA graphs run) and its MiniMax H3 VAE loader
    "UnetLoaderGGUF": ["MODEL"],
    "UnetLoaderGGUFAdvanced": ["MODEL"],
    "UnetLoaderGGUFDynamicVRAM": ["MODEL"],
    "CLIPLoaderGGUF": ["CLIP"],
    "DualCLIPLoaderGGUF": ["CLIP"],
    "TripleCLIPLoaderGGUF": ["CLIP"],
    "QuadrupleCLIPLoaderGGUF": ["CLIP"],
    "CLIPLoaderGGUFDynamicVRAM": ["CLIP"],
    "DualCLIPLoaderGGUFDynamicVRAM": ["CLIP"],
    "TripleCLIPLoaderGGUFDynamicVRAM": ["CLIP"],
    "QuadrupleCLIPLoaderGGUFDynamicVRAM": ["CLIP"],
    "VAELoaderGGUF": ["VAE"],
    **{name: ["RAY_ACTORS"] for name in RAYLIGHT_LOADERS},
}


class WorkflowError(Exception):
    """A document or file this tool cannot work on; the message says why."""


@dataclass
class Changes:
    """What one swap or reverse did to a document."""

    swapped: list = field(default_factory=list)  # loaders whose type changed, as they are now
    inserted: list = field(default_factory=list)  # (Apply node, the node it follows)
    removed: list = field(default_factory=list)  # (Apply node removed, the node it followed)
    kept: list = field(default_factory=list)  # pack nodes the reverse keeps: not inserted by this tool
    warnings: list = field(default_factory=list)

    def __bool__(self):
        return bool(self.swapped or self.inserted or self.removed)

    def kept_names(self) -> str:
        """The pack nodes the reverse kept, e.g. ``node 3 (MiniMaxHotfixApplyCLIP), node 7 (MiniMaxHotfixStatus)``."""
        return ", ".join(f"node {_node_id(node)} ({_node_type(node)})" for node in self.kept)

    def summary(self, reverse: bool) -> str:
        parts = []
        counts = collections.Counter(_node_type(node) for node in self.swapped)
        before = STOCK_TO_PACK if reverse else PACK_TO_STOCK
        parts += [f"{count} x {before[name]} -> {name}" for name, count in sorted(counts.items())]
        for verb, pairs in (("inserted", self.inserted), ("removed", self.removed)):
            parts += [f"{verb} {_node_type(apply)} after {_node_type(after)} (node {_node_id(after)})"
                      for apply, after in pairs]
        return ", ".join(parts) or "nothing to change"


def _node_type(node: dict) -> str:
    return node.get("type") or node.get("class_type")


def _node_id(node: dict):
    return node.get("id", node.get("_id"))


def workflow_format(doc) -> str:
    """``"ui"`` or ``"api"``; raises WorkflowError for anything else."""
    if isinstance(doc, dict) and isinstance(doc.get("nodes"), list):
        return "ui"
    if isinstance(doc, dict) and doc and all(
        isinstance(node, dict) and isinstance(node.get("class_type"), str) for node in doc.values()
    ):
        return "api"
    raise WorkflowError(
        "unrecognised format: expected a ComfyUI workflow, either UI format (an object with a \"nodes\" list) "
        "or API format (an object of nodes, each with a \"class_type\")"
    )


# ---- validation: everything the swap and the reverse read, checked before either changes anything ----

MAX_DEPTH = 200  # JSON nesting levels; ComfyUI's workflows have under 30, subgraphs nested ten deep included
LINK_FIELDS = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")


def json_type_name(value) -> str:
    """A JSON value's type, as an error message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _is_id(value) -> bool:
    """A node or link id as ComfyUI's frontend takes it (its workflow schema, workflowSchema.ts: ``zNodeId`` is an
    integer or a string, a link id any number); Python reads a JSON ``3.0`` as a float."""
    return isinstance(value, (int, float, str)) and not isinstance(value, bool)


def _is_slot_number(value) -> bool:
    """A link's origin or target slot: the frontend's ``zSlotIndex`` takes an integer or a string (parseInt). The
    swap reads none, and keeps each as it was."""
    return isinstance(value, (int, float, str)) and not isinstance(value, bool)


DATA_TYPE = "a string, a list of strings or a number"


def _is_data_type(value) -> bool:
    """A slot's or link's type: the frontend's ``zDataType`` is a string (``"MODEL"``, comma-joined ``"INT,FLOAT"``),
    a list of strings (a widget input typed by its options, as VHS_VideoCombine's ``format``) or a number. Only an
    object is no type at all; the swap compares types with ``==`` and hashes none."""
    return not isinstance(value, dict)


def _is_slot(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _Checker:
    """Raises WorkflowError as ``<label>: <where>: <what> is <found>, expected <expected>``."""

    def __init__(self, label: str):
        self.label = label

    def fail(self, where: str, what: str, found: str, expected: str):
        raise WorkflowError(f"{self.label}: {where}: {what} is {found}, expected {expected}")

    def require(self, ok: bool, where: str, what: str, value, expected: str) -> None:
        if not ok:
            self.fail(where, what, json_type_name(value), expected)

    def optional_list(self, holder: dict, key: str, where: str) -> list:
        """``holder[key]`` where it is a list; [] where it is absent or null."""
        value = holder.get(key)
        self.require(value is None or isinstance(value, list), where, f'"{key}"', value, "a list")
        return value or []


def _check_depth(doc) -> None:
    """Without recursion: a document too deep for the swap's own recursion (copies, subgraphs) stops here."""
    pending = [(doc, 1)] if isinstance(doc, (dict, list)) else []
    while pending:
        value, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise WorkflowError(f"nested more than {MAX_DEPTH} levels deep; no ComfyUI workflow is")
        children = value.values() if isinstance(value, dict) else value
        pending += [(child, depth + 1) for child in children if isinstance(child, (dict, list))]


def _check_ui_node(check: _Checker, node, prefix: str, index: int, in_group: bool, reverse: bool) -> None:
    """``prefix``: where the node list is ("" at the top level, "subgraph <id>, ", "group node <name>, ")."""
    where = f"{prefix}nodes[{index}]"
    check.require(isinstance(node, dict), where, "the node", node, "an object")
    if not in_group:  # a group node's nodes have an index instead
        check.require(_is_id(node.get("id")), where, '"id"', node.get("id"), "a number or a string")
        where = f"{prefix}node {node['id']}"
    # The frontend takes a group node's inner node without a type, and names it missing (groupNode.ts).
    check.require(isinstance(node.get("type"), str) or (in_group and node.get("type") is None), where, '"type"',
                  node.get("type"), "a string")
    properties = node.get("properties", {})
    check.require(isinstance(properties, dict), where, '"properties"', properties, "an object")
    original = properties.get(ORIGINAL_KEY)
    check.require(original is None or isinstance(original, dict), where, f'"properties.{ORIGINAL_KEY}"', original,
                  "an object or null")
    if reverse and INSERTED_KEY in properties:
        _check_marker(check, properties[INSERTED_KEY], where, f'"properties.{INSERTED_KEY}"', ui=True)
    for slot_index, slot in enumerate(check.optional_list(node, "inputs", where)):
        at = f'"inputs"[{slot_index}]'
        check.require(isinstance(slot, dict), where, at, slot, "an object")
        check.require(slot.get("link") is None or _is_id(slot["link"]), where, f'{at}.link', slot.get("link"),
                      "a link id or null")
        check.require(_is_data_type(slot.get("type")), where, f"{at}.type", slot.get("type"), DATA_TYPE)
    for slot_index, slot in enumerate(check.optional_list(node, "outputs", where)):
        at = f'"outputs"[{slot_index}]'
        check.require(isinstance(slot, dict), where, at, slot, "an object")
        check.require(_is_data_type(slot.get("type")), where, f"{at}.type", slot.get("type"), DATA_TYPE)
        for link_index, link_id in enumerate(check.optional_list(slot, "links", f"{where}, {at}")):
            check.require(_is_id(link_id), where, f"{at}.links[{link_index}]", link_id, "a link id")


def _check_marker(check: _Checker, marker, where: str, what: str, ui: bool) -> None:
    """The inserted Apply node's marker: ``{"after": [node id, output slot]}``; in UI format also ``"counters":
    {name: [last node id, last link id]}`` and, where the swap moved a link whose origin was written otherwise than
    ``after`` says (a slot number as a string, say), ``"origins": {link id: [origin id, origin slot]}``."""
    check.require(isinstance(marker, dict), where, what, marker, "an object")
    after = marker.get("after")
    check.require(isinstance(after, list) and len(after) == 2 and _is_id(after[0]) and _is_slot(after[1]), where,
                  f"{what[:-1]}.after\"", after, "[node id, output slot]")
    if not ui:
        return
    counters = marker.get("counters", {})
    check.require(isinstance(counters, dict), where, f'{what[:-1]}.counters"', counters, "an object")
    for name, pair in counters.items():
        # As the counters were: the frontend's schema takes last_node_id as a node id, the others as any number.
        check.require(isinstance(pair, list) and len(pair) == 2 and all(
            value is None or _is_id(value) for value in pair),
            where, f'{what[:-1]}.counters.{name}"', pair, "[last node id, last link id]")
    origins = marker.get("origins", {})
    check.require(isinstance(origins, dict), where, f'{what[:-1]}.origins"', origins, "an object")
    for link_id, origin in origins.items():
        check.require(isinstance(origin, list) and len(origin) == 2 and _is_id(origin[0])
                      and _is_slot_number(origin[1]), where, f'{what[:-1]}.origins.{link_id}"', origin,
                      "[origin id, origin slot]")


def _check_ui_link(check: _Checker, link, where: str) -> None:
    if isinstance(link, list):
        if len(link) < len(LINK_FIELDS):
            check.fail(where, "the link", f"a list of {len(link)}", f"{len(LINK_FIELDS)}: " + ", ".join(LINK_FIELDS))
        values = dict(zip(LINK_FIELDS, link, strict=False))
    else:
        check.require(isinstance(link, dict), where, "the link", link, "a list or an object")
        missing = [name for name in LINK_FIELDS if name not in link]
        if missing:
            check.fail(where, f'"{missing[0]}"', "missing", "a link with " + ", ".join(LINK_FIELDS))
        values = link
    for name in ("id", "origin_id", "target_id"):
        check.require(_is_id(values[name]), where, f'"{name}"', values[name], "a number or a string")
    for name in ("origin_slot", "target_slot"):
        check.require(_is_slot_number(values[name]), where, f'"{name}"', values[name], "a number or a string")
    check.require(_is_data_type(values["type"]), where, '"type"', values["type"], DATA_TYPE)


def _check_ui(doc: dict, reverse: bool) -> None:
    check = _Checker("malformed UI workflow")
    pending = [(doc, "")]
    while pending:
        graph, name = pending.pop()
        prefix = f"{name}, " if name else ""
        for index, node in enumerate(check.optional_list(graph, "nodes", name or "top level")):
            _check_ui_node(check, node, prefix, index, in_group=False, reverse=reverse)
        for index, link in enumerate(check.optional_list(graph, "links", name or "top level")):
            _check_ui_link(check, link, f"{prefix}links[{index}]")
        definitions = graph.get("definitions")
        if definitions is None:
            continue
        check.require(isinstance(definitions, dict), name or "top level", '"definitions"', definitions, "an object")
        for index, subgraph in enumerate(check.optional_list(definitions, "subgraphs", name or "top level")):
            at = f"{prefix}definitions.subgraphs[{index}]"
            check.require(isinstance(subgraph, dict), at, "the subgraph", subgraph, "an object")
            check.require(_is_id(subgraph.get("id")), at, '"id"', subgraph.get("id"), "a string")
            check.require(isinstance(subgraph.get("nodes"), list), f"subgraph {subgraph['id']}", '"nodes"',
                          subgraph.get("nodes"), "a list")
            pending.append((subgraph, f"subgraph {subgraph['id']}"))
    extra = doc.get("extra")
    group_nodes = extra.get("groupNodes") if isinstance(extra, dict) else None
    if group_nodes is None:
        return
    check.require(isinstance(group_nodes, dict), "extra", '"groupNodes"', group_nodes, "an object")
    for group_name, group in group_nodes.items():
        where = f"group node {group_name}"
        check.require(isinstance(group, dict), where, "the group", group, "an object")
        for index, node in enumerate(check.optional_list(group, "nodes", where)):
            _check_ui_node(check, node, f"{where}, ", index, in_group=True, reverse=reverse)


def _check_api(doc: dict, reverse: bool) -> None:
    check = _Checker("malformed API workflow")
    for node_id, node in doc.items():
        where = f"node {node_id}"
        for key in ("inputs", "_meta"):
            check.require(node.get(key) is None or isinstance(node[key], dict), where, f'"{key}"', node.get(key),
                          "an object")
        if reverse and INSERTED_KEY in (node.get("_meta") or {}):
            _check_marker(check, node["_meta"][INSERTED_KEY], where, f'"_meta.{INSERTED_KEY}"', ui=False)


def _check_only(only, workflow: str, reverse: bool) -> None:
    if only is None:
        return
    if workflow != "ui" or reverse:
        raise WorkflowError('"only" names one node to swap in a UI-format workflow; it does not go with an API-format '
                            "workflow or the reverse")
    if not isinstance(only, dict):
        raise WorkflowError(f'"only" is {json_type_name(only)}, expected {{"graph": subgraph id or null, '
                            '"node": node id}')
    if not _is_id(only.get("node")):
        raise WorkflowError(f'"only.node" is {json_type_name(only.get("node"))}, expected a node id')
    if not (only.get("graph") is None or _is_id(only["graph"])):
        raise WorkflowError(f'"only.graph" is {json_type_name(only["graph"])}, expected a subgraph id or null')


def validate(doc, reverse: bool = False, only=None) -> str:
    """``"ui"`` or ``"api"`` for a document that ``swap(doc, reverse, only=only)`` can work on; WorkflowError naming
    what is wrong and where (node, link, subgraph, field) for anything else. ``swap()`` calls it before it changes
    anything, so a document it refuses is left as it was."""
    _check_depth(doc)
    workflow = workflow_format(doc)
    (_check_ui if workflow == "ui" else _check_api)(doc, reverse)
    _check_only(only, workflow, reverse)
    return workflow


def _graphs(graph: dict):
    """The graph and every subgraph definition below it, however deeply nested (of a validated document)."""
    yield graph
    for subgraph in (graph.get("definitions") or {}).get("subgraphs") or []:
        yield from _graphs(subgraph)


def _group_nodes(doc: dict) -> list[dict]:
    """The inner nodes of legacy group nodes, but those without a type: the frontend names them missing, and there
    is nothing to swap in them."""
    extra = doc.get("extra")
    group_nodes = extra.get("groupNodes") if isinstance(extra, dict) else None
    return [node for group in (group_nodes or {}).values() for node in group.get("nodes") or []
            if isinstance(node.get("type"), str)]


def ui_nodes(doc: dict) -> list[dict]:
    """Every node of a validated UI-format workflow: top level, subgraphs, and legacy group nodes
    (``extra.groupNodes``)."""
    return [node for graph in _graphs(doc) for node in graph.get("nodes") or []] + _group_nodes(doc)


# ---- stock loaders, in place ----

def _core_version(nodes: list[dict]):
    """The ComfyUI version most of the workflow's core nodes carry (None when none carries one)."""
    versions = collections.Counter(
        node["properties"]["ver"]
        for node in nodes
        if isinstance(node.get("properties"), dict)
        and node["properties"].get("cnr_id") == CORE_CNR_ID
        and isinstance(node["properties"].get("ver"), str)
    )
    return versions.most_common(1)[0][0] if versions else None


def _attribute(node: dict, node_type: str, cnr_id: str, ver) -> None:
    """Sets type and attribution in place, so keys that exist keep their position in the document."""
    node["type"] = node_type
    properties = node.setdefault("properties", {})
    properties["cnr_id"] = cnr_id
    if ver is None:
        properties.pop("ver", None)
    else:
        properties["ver"] = ver
    properties["Node name for S&R"] = node_type


def _reverse_ui_loader(node: dict, core_ver) -> None:
    stock = PACK_TO_STOCK[node["type"]]
    properties = node.get("properties")
    if not isinstance(properties, dict) or ORIGINAL_KEY not in properties:
        _attribute(node, stock, CORE_CNR_ID, core_ver)
        return
    original = properties.pop(ORIGINAL_KEY)
    node["type"] = stock
    for key in ATTRIBUTION_KEYS:
        if original and key in original:
            properties[key] = original[key]
        else:
            properties.pop(key, None)
    if original is None and not properties:
        del node["properties"]


def _swap_ui_loaders(nodes: list[dict], version: str, chosen) -> list[dict]:
    swapped = []
    for node in nodes:
        if node["type"] not in STOCK_TO_PACK or not chosen(node):
            continue
        before = copy.deepcopy(node)
        properties = node.get("properties")
        original = None if properties is None else {key: properties[key] for key in ATTRIBUTION_KEYS if key in properties}
        _attribute(node, STOCK_TO_PACK[node["type"]], PACK_CNR_ID, version)
        node["properties"][ORIGINAL_KEY] = original
        swapped.append((node, before))
    # Keep the original attribution only where the reverse could not recompute it exactly.
    core_ver = _core_version(nodes)
    for node, before in swapped:
        trial = copy.deepcopy(node)
        del trial["properties"][ORIGINAL_KEY]
        _reverse_ui_loader(trial, core_ver)
        if json.dumps(trial) == json.dumps(before):
            del node["properties"][ORIGINAL_KEY]
    return [node for node, _ in swapped]


# ---- UI format: links, ids, inserted Apply nodes ----

class _Links:
    """One graph's links, whichever form they take: arrays at the top level of schema 0.4
    ``[id, origin_id, origin_slot, target_id, target_slot, type]``, objects in subgraphs and schema 1."""

    FIELDS = LINK_FIELDS

    def __init__(self, graph: dict, root: bool):
        self.graph = graph
        self.items = graph.get("links") or []  # absent or null: a list once a link is added
        self.objects = any(isinstance(link, dict) for link in self.items) or (not self.items and not root)

    def get(self, link, key):
        return link[key] if isinstance(link, dict) else link[self.FIELDS.index(key)]

    def set(self, link, key, value):
        if isinstance(link, dict):
            link[key] = value
        else:
            link[self.FIELDS.index(key)] = value

    def by_id(self) -> dict:
        return {self.get(link, "id"): link for link in self.items}

    def add(self, link_id, origin_id, origin_slot, target_id, target_slot, link_type):
        values = (link_id, origin_id, origin_slot, target_id, target_slot, link_type)
        self.graph["links"] = self.items
        self.items.append(dict(zip(self.FIELDS, values, strict=True)) if self.objects else list(values))

    def remove(self, link_id) -> None:
        self.items[:] = [link for link in self.items if self.get(link, "id") != link_id]


def _counters(doc: dict) -> list[tuple[str, dict, str, str]]:
    """(name, holder, node-id key, link-id key) of every id counter: ComfyUI's frontend shares one state between the
    root graph and its subgraphs, so node and link ids are unique across all of them. The name, under which an
    inserted node's marker records the counter: "root" for the top level's ``last_node_id``/``last_link_id``,
    "state" for the top level's ``state``, the subgraph id (as a string) for a subgraph's ``state``."""
    found = []
    if "last_node_id" in doc or "last_link_id" in doc:
        found.append(("root", doc, "last_node_id", "last_link_id"))
    for graph in _graphs(doc):
        if isinstance(graph.get("state"), dict):
            found.append(("state" if graph is doc else str(graph.get("id")), graph["state"], "lastNodeId",
                          "lastLinkId"))
    return found


def _counter_values(doc: dict) -> dict:
    """{counter name (see ``_counters``): [last node id, last link id]} for the counters present."""
    return {name: [holder.get(node_key), holder.get(link_key)] for name, holder, node_key, link_key in _counters(doc)}


def _set_counter_values(doc: dict, values: dict) -> None:
    for name, holder, node_key, link_key in _counters(doc):
        for key, value in zip((node_key, link_key), values.get(name, ()), strict=False):
            if key in holder:
                holder[key] = value


def _numeric(value) -> int:
    """An id or id counter as the integer that new ids must come after; 0 where it is no number. The frontend keeps
    nodes under their id as an object key, so the string "7" is node 7; a link id may be a fraction."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    if isinstance(value, float) and math.isfinite(value):
        return math.floor(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _number(value) -> float:
    """A position or size coordinate; 0 for anything that is not a finite number."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < float("inf") \
        else 0


def _vector(value) -> tuple:
    """(x, y) of a position or size, 0 for what is missing: the frontend's schema (``zVector2``) takes a pair or an
    object ``{"0": x, "1": y}``."""
    if isinstance(value, dict):
        value = [value.get("0"), value.get("1")]
    if not isinstance(value, list):
        return 0, 0
    return tuple(_number(value[index]) if index < len(value) else 0 for index in (0, 1))


def _same_json(first, second) -> bool:
    """Equal as written: 0, 0.0, "0" and false differ here, unlike in ``==``."""
    return json.dumps(first) == json.dumps(second)


class _Ids:
    """Allocates node and link ids above every id and counter of the document."""

    def __init__(self, doc: dict):
        self.doc = doc
        self.node = max([0] + [_numeric(node.get("id")) for graph in _graphs(doc) for node in graph.get("nodes", [])]
                        + [_numeric(holder.get(key)) for _, holder, key, _ in _counters(doc)])
        self.link = max([0] + [_numeric(link["id"] if isinstance(link, dict) else link[0])
                               for graph in _graphs(doc) for link in graph.get("links") or []]
                        + [_numeric(holder.get(key)) for _, holder, _, key in _counters(doc)])

    def next_node(self) -> int:
        self.node += 1
        self._store()
        return self.node

    def next_link(self) -> int:
        self.link += 1
        self._store()
        return self.link

    def _store(self) -> None:
        for _, holder, node_key, link_key in _counters(self.doc):
            if node_key in holder:
                holder[node_key] = self.node
            if link_key in holder:
                holder[link_key] = self.link


def _subgraph_ids(doc: dict) -> set:
    return {graph.get("id") for graph in _graphs(doc) if graph is not doc}


def _model_type(slot):
    """The slot's type where it is one that gets an Apply node (MODEL, CLIP, VAE), else None: a list of options, a
    comma-joined string or a number is none of them."""
    io_type = slot.get("type") if isinstance(slot, dict) else None
    return io_type if isinstance(io_type, str) and io_type in APPLY_NODE else None


def _model_sources(graph: dict, subgraph_ids: set):
    """(node, output slot, io type) of each output that makes a new MODEL, CLIP or VAE: the node has no input of
    that type (LoRA, sampling and switch nodes pass one on), is no stock or pack node, no reroute, no subgraph."""
    for node in graph.get("nodes", []):
        node_type = node["type"]
        if (node_type in STOCK_TO_PACK or node_type.startswith(RULES["pack_node_prefix"])
                or node_type in RULES["pass_through_types"] or node_type in subgraph_ids):
            continue
        input_types = {_model_type(slot) for slot in node.get("inputs") or []}
        for slot, output in enumerate(node.get("outputs") or []):
            io_type = _model_type(output)
            if io_type and io_type not in input_types:
                yield node, slot, io_type


def _insert_ui_apply_nodes(doc: dict, version: str, chosen) -> tuple[list, list]:
    inserted, warnings = [], []
    ids = _Ids(doc)
    counters_before = _counter_values(doc)
    subgraph_ids = _subgraph_ids(doc)
    for graph in _graphs(doc):
        links = _Links(graph, root=graph is doc)
        nodes = {node.get("id"): node for node in graph.get("nodes", [])}
        for source, slot, io_type in list(_model_sources(graph, subgraph_ids)):
            if not chosen(source):
                continue
            apply_type, input_name = APPLY_NODE[io_type]
            output = source["outputs"][slot]
            by_id = links.by_id()
            consumers = [link_id for link_id in output.get("links") or []
                         if link_id in by_id
                         and nodes.get(links.get(by_id[link_id], "target_id"), {}).get("type") != apply_type]
            if not consumers:
                continue  # unused, or every consumer already is the Apply node
            apply_id, in_link = ids.next_node(), ids.next_link()
            origins = {}  # what the reverse cannot recompute from the marker's "after"
            for link_id in consumers:
                origin = [links.get(by_id[link_id], "origin_id"), links.get(by_id[link_id], "origin_slot")]
                if not _same_json(origin, [source["id"], slot]):
                    origins[str(link_id)] = origin
                links.set(by_id[link_id], "origin_id", apply_id)
                links.set(by_id[link_id], "origin_slot", 0)
            kept = [link_id for link_id in output["links"] if link_id not in consumers]
            output["links"] = kept + [in_link]
            links.add(in_link, source["id"], slot, apply_id, 0, io_type)
            apply = _apply_ui_node(apply_id, apply_type, input_name, io_type, source, slot, in_link, consumers,
                                   version, {"counters": counters_before, **({"origins": origins} if origins else {})})
            graph["nodes"].append(apply)
            nodes[apply_id] = apply
            inserted.append((apply, source))
    for node in _group_nodes(doc):
        if any(_model_type(output) for output in node.get("outputs") or []) and node["type"] not in STOCK_TO_PACK \
                and not node["type"].startswith(RULES["pack_node_prefix"]):
            warnings.append(f"node {node['type']} inside a group node was left as it is: convert the group node "
                            f"to a subgraph in ComfyUI and run again, or put the Apply node after it by hand")
    return inserted, warnings


def _apply_ui_node(apply_id, apply_type, input_name, io_type, source, slot, in_link, consumers, version, restore):
    """``restore``: the marker's "counters" and "origins" (see ``_check_marker``)."""
    x, y = _vector(source.get("pos"))
    width, _ = _vector(source.get("size"))
    return {
        "id": apply_id,
        "type": apply_type,
        "pos": [x + width + RULES["apply_node_gap"], y + slot * 2 * RULES["apply_node_size"][1]],
        "size": list(RULES["apply_node_size"]),
        "flags": {},
        "mode": 0,
        "inputs": [{"localized_name": input_name, "name": input_name, "type": io_type, "link": in_link}],
        "outputs": [{"localized_name": io_type, "name": io_type, "type": io_type, "links": consumers}],
        "properties": {"cnr_id": PACK_CNR_ID, "ver": version, "Node name for S&R": apply_type,
                       INSERTED_KEY: {"after": [source["id"], slot], **restore}},
        "widgets_values": [],
    }


def _remove_ui_apply_nodes(doc: dict) -> tuple[list, list]:
    removed, warnings, markers, allocated_nodes, allocated_links = [], [], [], [], []
    for graph in _graphs(doc):
        links = _Links(graph, root=graph is doc)
        nodes = {node.get("id"): node for node in graph.get("nodes", [])}
        for apply in [node for node in graph.get("nodes", []) if INSERTED_KEY in (node.get("properties") or {})]:
            marker = apply["properties"][INSERTED_KEY]
            source_id, slot = marker["after"]
            source = nodes.get(source_id)
            in_link = (apply.get("inputs") or [{}])[0].get("link")
            by_id = links.by_id()
            source_outputs = (source or {}).get("outputs") or []
            if (source is None or slot >= len(source_outputs) or not apply.get("outputs") or in_link not in by_id
                    or in_link not in (source_outputs[slot].get("links") or [])):
                warnings.append(f"node {apply['id']} ({apply['type']}) is no longer connected to node {source_id}: "
                                "left as it is")
                continue
            consumers = apply["outputs"][0].get("links") or []
            origins = marker.get("origins", {})
            for link_id in consumers:
                if link_id in by_id:
                    origin_id, origin_slot = origins.get(str(link_id), (source_id, slot))
                    links.set(by_id[link_id], "origin_id", origin_id)
                    links.set(by_id[link_id], "origin_slot", origin_slot)
            output_links = source["outputs"][slot]["links"]
            at = output_links.index(in_link)
            output_links[at:at + 1] = consumers
            links.remove(in_link)
            graph["nodes"].remove(apply)
            removed.append((apply, source))
            markers.append(marker)
            allocated_nodes.append(apply["id"])
            allocated_links.append(in_link)
    if markers:
        _restore_counters(doc, markers, max(allocated_nodes), max(allocated_links))
    return removed, warnings


def _earliest(counters):
    """The first of counter values recorded by successive swaps: null where one recorded null (the counter was null
    before the first swap), else a string (only the original can hold one: the swap writes numbers), else the
    smallest."""
    return min(counters, key=lambda value: (value is not None, not isinstance(value, str),
                                            0 if value is None or isinstance(value, str) else value))


def _restore_counters(doc: dict, markers: list, last_node: int, last_link: int) -> None:
    """Puts back the id counters of before the swap, where nothing was added since (they still end at the ids
    the swap allocated)."""
    now = _counter_values(doc)
    restored = {}
    for key, (node_counter, link_counter) in now.items():
        before = [marker["counters"][key] for marker in markers if key in marker.get("counters", {})]
        if not before:
            continue
        restored[key] = [_earliest(b[0] for b in before) if node_counter == last_node else node_counter,
                         _earliest(b[1] for b in before) if link_counter == last_link else link_counter]
    _set_counter_values(doc, restored)


# ---- API format ----

def _api_consumers(doc: dict, node_id: str, slot=None):
    """(consumer id, input name) of every input taking output ``slot`` (any output: None) of ``node_id``."""
    return [(consumer_id, name) for consumer_id, node in doc.items()
            for name, value in (node.get("inputs") or {}).items()
            if isinstance(value, list) and len(value) == 2 and str(value[0]) == node_id
            and (slot is None or value[1] == slot)]


def _consumers_by_source(doc: dict, sources: set, model_inputs: set) -> dict:
    """In one pass, the inputs that matter to the Apply nodes: every input taking an output of ``sources`` (the loaders
    with known outputs), and every ``model_inputs`` input (for the warning about loaders of unknown outputs): source
    id -> [(slot, consumer id, input name)]."""
    found = collections.defaultdict(list)
    for consumer_id, node in doc.items():
        for name, value in (node.get("inputs") or {}).items():
            if type(value) is list and len(value) == 2:
                source = value[0] if type(value[0]) is str else str(value[0])
                if source in sources or name.lower() in model_inputs:
                    found[source].append((value[1], consumer_id, name))
    return found


def _insert_api_apply_nodes(doc: dict, loader_outputs: Callable[[str], list | None]) -> tuple[list, list]:
    """Inserts the Apply nodes, replacing every node it changes with a changed copy (the nodes themselves are never
    written to, so a caller's shallow copy of ``doc`` keeps its original intact)."""
    inserted, warnings = [], []
    model_inputs = {input_name for _, input_name in APPLY_NODE.values()}
    outputs_by_type = {class_type: loader_outputs(class_type) for class_type in {n["class_type"] for n in doc.values()}}
    sources = {node_id for node_id, node in doc.items() if outputs_by_type[node["class_type"]] is not None}
    consumers = _consumers_by_source(doc, sources, model_inputs)
    copied: set = set()
    next_id = max([0] + [int(key) for key in map(str, doc) if key.isascii() and key.isdigit()]) + 1
    for node_id, node in [(node_id, node) for node_id, node in doc.items() if node_id in consumers]:
        class_type = node["class_type"]
        if class_type in STOCK_TO_PACK or class_type.startswith(RULES["pack_node_prefix"]):
            continue
        outputs = outputs_by_type[class_type]
        if outputs is None:
            own_inputs = {name.lower() for name in node.get("inputs") or {}}
            fed = sorted({name for _, _, name in consumers[node_id]
                          if name.lower() in model_inputs and name.lower() not in own_inputs})
            if fed:
                warnings.append(f"node {node_id} ({class_type}) feeds {', '.join(fed)} but its output types are "
                                "unknown in API format: if it loads a model, run the tool on the UI-format workflow "
                                "or put the matching MiniMaxHotfixApply node after it by hand")
            continue
        for slot, io_type in enumerate(outputs):
            if io_type not in APPLY_NODE:
                continue
            apply_type, input_name = APPLY_NODE[io_type]
            taking = [(cid, name) for taken, cid, name in consumers.get(node_id, ())
                      if taken == slot and doc[cid]["class_type"] != apply_type]
            if not taking:
                continue
            apply_id = str(next_id)
            next_id += 1
            for consumer_id, name in taking:
                if consumer_id not in copied:
                    copied.add(consumer_id)
                    doc[consumer_id] = {**doc[consumer_id], "inputs": dict(doc[consumer_id]["inputs"])}
                doc[consumer_id]["inputs"][name] = [apply_id, 0]
            apply = {"inputs": {input_name: [node_id, slot]}, "class_type": apply_type,
                     "_meta": {"title": apply_type, INSERTED_KEY: {"after": [node_id, slot]}}}
            doc[apply_id] = apply
            inserted.append(({"id": apply_id, **apply}, {"id": node_id, **node}))
    return inserted, warnings


def _is_api_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def api_model_sources(prompt: dict, node_id: str, models: Iterable[str],
                  output_types: Callable[[str], Sequence[str]]) -> tuple[list[str], list[str]]:
    """Where the models of types ``models`` that node ``node_id`` of the API-format ``prompt`` uses come from: (the
    pack's nodes they pass through last, the loaders they come from without passing a pack node), as node ids.
    ``output_types(class_type)`` gives a node type's output types. Every link upstream is followed (a sampler takes
    its model through a guider), but a node counts only where a link of one of ``models`` leaves it: a loader gives
    that type without taking it in (a node that takes it in, a LoRA loader say, passes the loader's model on)."""
    models = set(models)

    def takes(node_id: str) -> set[str]:
        types = set()
        for value in prompt[node_id].get("inputs", {}).values():
            if _is_api_link(value) and value[0] in prompt:
                source_types = output_types(prompt[value[0]]["class_type"])
                if value[1] < len(source_types):
                    types.add(source_types[value[1]])
        return types

    through_pack, loaders, seen, todo = {}, {}, {node_id}, [node_id]
    while todo:
        for value in prompt[todo.pop()].get("inputs", {}).values():
            if not _is_api_link(value) or value[0] not in prompt:
                continue
            source, slot = value
            outputs = output_types(prompt[source]["class_type"])
            model = outputs[slot] if slot < len(outputs) and outputs[slot] in models else None
            if model and prompt[source]["class_type"].startswith(RULES["pack_node_prefix"]):
                through_pack[source] = None
                continue  # what lies above it reached this node through the pack
            if model and model not in takes(source):
                loaders[source] = None
            if source not in seen:
                seen.add(source)
                todo.append(source)
    return list(through_pack), list(loaders)


def _remove_api_apply_nodes(doc: dict) -> list:
    removed = []
    for apply_id, apply in list(doc.items()):
        marker = (apply.get("_meta") or {}).get(INSERTED_KEY)
        if not marker:
            continue
        source_id, slot = marker["after"]
        for consumer_id, name in _api_consumers(doc, apply_id, 0):
            doc[consumer_id]["inputs"][name] = [source_id, slot]
        del doc[apply_id]
        removed.append(({"id": apply_id, **apply}, {"id": source_id, **doc.get(source_id, {"class_type": "?"})}))
    return removed


# ---- the swap ----

def _chosen_node(doc: dict, only: dict):
    """The node ``only`` names: ``{"graph": subgraph id, or None for the top level, "node": node id}``. The id may
    come as a string (the frontend keeps node ids as strings on its live nodes, numbers in the document)."""
    for graph in _graphs(doc):
        if (graph is doc) == (only.get("graph") is None) and (graph is doc or graph.get("id") == only["graph"]):
            for node in graph.get("nodes", []):
                if str(node.get("id")) == str(only.get("node")):
                    return node
    raise WorkflowError(f"no node {only.get('node')} in graph {only.get('graph') or 'top level'}")


def swap_api(prompt: dict, loader_outputs: Callable[[str], list | None] | None = None) -> Changes:
    """The swap of an API-format ``prompt`` that ``validate`` accepted, in one pass over its nodes: ``prompt``'s
    entries are replaced by changed copies, the nodes themselves never written to, so the server's on-prompt handler
    swaps a shallow copy and leaves the client's prompt as it came (registry/prompt_fixing.py). Checks the nodes'
    shape first (WorkflowError before anything changes); not their depth, which only ``swap``'s callers that copy or
    render the whole document need (``validate``). ``loader_outputs``: a node type's output types where it makes a
    new MODEL, CLIP or VAE (an output of another type, or one it passes on, as None), else None; a server knows
    every node type it has (nodes/prompt_fixing.py), a file alone only ``API_LOADER_OUTPUTS`` (None: that table)."""
    if workflow_format(prompt) != "api":
        raise WorkflowError("expected an API-format workflow (an object of nodes, each with a \"class_type\")")
    _check_api(prompt, reverse=False)
    changes = Changes()
    for key, node in list(prompt.items()):
        if node["class_type"] in STOCK_TO_PACK:
            prompt[key] = {**node, "class_type": STOCK_TO_PACK[node["class_type"]]}
            changes.swapped.append(prompt[key])
    changes.inserted, changes.warnings = _insert_api_apply_nodes(prompt, loader_outputs or API_LOADER_OUTPUTS.get)
    return changes


def swap(doc, reverse: bool = False, version: str = VERSION, only: dict | None = None) -> Changes:
    """Swaps ``doc`` in place (stock -> pack, or pack -> stock with ``reverse``); returns what changed. ``only``
    (UI format, swap only) limits the swap to one node: ``{"graph": subgraph id or None, "node": node id}``.
    A document or ``only`` that ``validate`` refuses raises WorkflowError before anything changes."""
    changes = Changes()
    if validate(doc, reverse, only) == "api":
        if reverse:
            changes.removed = _remove_api_apply_nodes(doc)
            changes.swapped = [node for node in doc.values() if node["class_type"] in PACK_TO_STOCK]
            for node in changes.swapped:
                node["class_type"] = PACK_TO_STOCK[node["class_type"]]
            changes.kept = [{"id": key, **node} for key, node in doc.items()
                            if node["class_type"].startswith(RULES["pack_node_prefix"])]
        else:
            changes = swap_api(doc)
        return changes
    nodes = ui_nodes(doc)
    if reverse:
        changes.removed, changes.warnings = _remove_ui_apply_nodes(doc)
        core_ver = _core_version(nodes)
        changes.swapped = [node for node in nodes if node["type"] in PACK_TO_STOCK]
        for node in changes.swapped:
            _reverse_ui_loader(node, core_ver)
        changes.kept = [node for node in ui_nodes(doc) if node["type"].startswith(RULES["pack_node_prefix"])]
        return changes
    target = _chosen_node(doc, only) if only else None
    chosen = lambda node: target is None or node is target
    changes.swapped = _swap_ui_loaders(nodes, version, chosen)
    changes.inserted, changes.warnings = _insert_ui_apply_nodes(doc, version, chosen)
    return changes


# ---- documents from text ----

BOM = "\ufeff"


def parse_json(text: str, allow_nan: bool = True):
    """The JSON document in ``text`` (a UTF-8 byte order mark allowed); WorkflowError for malformed or too deeply
    nested JSON, and without ``allow_nan`` for NaN and Infinity, which Python writes and browsers cannot read."""

    def no_constant(name):
        raise WorkflowError(f"{name} is not a JSON number")

    try:
        return json.loads(text.removeprefix(BOM), **({} if allow_nan else {"parse_constant": no_constant}))
    except json.JSONDecodeError as exc:
        raise WorkflowError(f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise WorkflowError(f"nested more than {MAX_DEPTH} levels deep; no ComfyUI workflow is") from None


def rules_module() -> str:
    """web/swap_rules.js: the rules as an ES module for the frontend extension."""
    return ("// Generated by `python tools/swap_loaders.py --print-rules > web/swap_rules.js`; do not edit.\n"
            f"export const RULES = {json.dumps(RULES, indent=2)};\n")
