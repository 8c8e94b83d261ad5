"""Hypothesis set-up and workflow strategies shared by the fuzz tests of the swap tool (tests/test_swap_loaders_fuzz.py)
and of its route in a real ComfyUI (tests/test_workflows.py).

The profile "ci" (the default) is reproducible: derandomized (the same examples on every run), no example database,
no deadline (2 shared CI cores are slow at times). HYPOTHESIS_PROFILE=explore draws new random examples and ten
times as many: a failure it finds is kept as an explicit regression case in the test file.

Seeds of the mutations: the bundled workflows (as shipped and back on stock loaders), every official MiniMax template
of comfyui-workflow-templates-json (as shipped and swapped, for the reverse), the two Music 3 user workflows, and
the bundled workflows in API format.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

PACK_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PACK_ROOT / "tools"))
import swap_loaders
from user_workflows import music3_checkpoint, music3_gguf
from workflow_api import TEMPLATES, load, ui_to_api

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
    users = [music3_gguf(), music3_checkpoint()]
    return tuple(templates + [_swapped(doc) for doc in templates] + bundled + [_stock(doc) for doc in bundled]
                 + users + [_swapped(doc) for doc in users])


@cache
def api_seeds() -> tuple[dict, ...]:
    specs = load(Path(__file__).with_name("workflow_node_specs.json"))["nodes"]
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
    """(container, key) of every value in ``doc``, without recursion."""
    found, pending = [], [doc]
    while pending:
        container = pending.pop()
        keys = list(container) if isinstance(container, dict) else range(len(container))
        for key in keys:
            found.append((container, key))
            if isinstance(container[key], (dict, list)):
                pending.append(container[key])
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
    """A seed with one to three ordinary damages: a field of another type, a key missing, a list cut short, an
    element duplicated, a value nested deep (up to past the tool's limit)."""
    doc = copy.deepcopy(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(doc)
        if not slots:
            break
        interesting = [(container, key) for container, key in slots if key in KEYS]
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


def workflows():
    """Every kind of document the fuzz tests hand the tool: mutated UI and API workflows, generated UI workflows,
    and arbitrary JSON."""
    return st.one_of(mutated(ui_seeds()), mutated(api_seeds()), generated_ui(), json_values,
                     st.dictionaries(st.sampled_from(KEYS), json_values, max_size=4))


def layouts():
    """How a file is written: indentation, compact or not, CRLF line ends, a UTF-8 byte order mark."""
    return st.fixed_dictionaries({"indent": st.sampled_from([None, 2, "\t"]), "crlf": st.booleans(),
                                  "bom": st.booleans()})


def file_bytes(doc, layout: dict) -> bytes:
    text = json.dumps(doc, indent=layout["indent"]) + "\n"
    if layout["crlf"]:
        text = text.replace("\n", "\r\n")
    return (b"\xef\xbb\xbf" if layout["bom"] else b"") + text.encode("utf-8")
