"""The swap (swap_loaders.py) and its command line (tools/swap_loaders.py): swaps every stock loader (subgraphs,
group nodes and API format included), inserts the Apply node after every other MODEL/CLIP/VAE loader, changes nothing
else, reverses exactly, writes safely (atomically, through symlinks, keeping mode and owner, never a read-only file or
its input unless told to), and fails clearly with one prefix."""

from __future__ import annotations

import ast
import copy
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import swap_loaders as command_line  # tools/swap_loaders.py (tests/conftest.py puts tools/ on the path)
from hotfix_testing import raylight_source
from hotfix_testing.user_workflows import music3_checkpoint, music3_gguf
from hotfix_testing.workflow_fuzzing import minimax_templates
from minimax_hotfix import swap_loaders
from minimax_hotfix.swap_loaders import ATTRIBUTION_KEYS, INSERTED_KEY, ORIGINAL_KEY, PACK_TO_STOCK, STOCK_TO_PACK

PACK_ROOT = Path(__file__).resolve().parents[1]
TOOL = PACK_ROOT / "tools" / "swap_loaders.py"

pytestmark = pytest.mark.stdlib  # the swap tool is standard library only: run 1 alone runs these

MINIMAX_TEMPLATES = list(minimax_templates())


def _loader_paths(doc):
    """(where, node id, type) of every loader: top level or the subgraph it sits in."""
    paths = []
    for graph in swap_loaders._graphs(doc):
        where = "top" if graph is doc else graph.get("id")
        paths += [(where, node["id"], node["type"]) for node in graph.get("nodes", [])
                  if node["type"] in STOCK_TO_PACK or node["type"] in PACK_TO_STOCK]
    return paths


def _without_attribution(doc):
    """The document with node types and the swapped attribution blanked, to compare everything else."""
    doc = copy.deepcopy(doc)
    for node in swap_loaders.ui_nodes(doc):
        if node["type"] in STOCK_TO_PACK or node["type"] in PACK_TO_STOCK:
            node["type"] = "loader"
            for key in (*ATTRIBUTION_KEYS, ORIGINAL_KEY):
                node.get("properties", {}).pop(key, None)
    return doc


def _graph_links(graph):
    """{link id: (origin id, origin slot, target id, target slot, type)} of one graph, arrays or objects."""
    fields = ("origin_id", "origin_slot", "target_id", "target_slot", "type")
    return {(link["id"] if isinstance(link, dict) else link[0]):
            tuple(link[key] for key in fields) if isinstance(link, dict) else tuple(link[1:6])
            for link in graph.get("links", [])}


def assert_rewired(original, swapped):
    """Each inserted Apply node takes its loader's output, and every link that left that output now leaves the
    Apply node, at both ends; nothing else moved."""
    for graph_before, graph in zip(swap_loaders._graphs(original), swap_loaders._graphs(swapped), strict=True):
        before, after = _graph_links(graph_before), _graph_links(graph)
        nodes = {node["id"]: node for node in graph["nodes"]}
        for apply in [node for node in graph["nodes"] if INSERTED_KEY in node.get("properties", {})]:
            source_id, slot = apply["properties"][INSERTED_KEY]["after"]
            io_type = nodes[source_id]["outputs"][slot]["type"]
            assert apply["type"] == swap_loaders.APPLY_NODE[io_type][0]
            in_link = apply["inputs"][0]["link"]
            assert after[in_link] == (source_id, slot, apply["id"], 0, io_type)
            assert nodes[source_id]["outputs"][slot]["links"] == [in_link]
            moved = [link_id for link_id, link in before.items() if link[:2] == (source_id, slot)]
            assert moved and apply["outputs"][0]["links"] == moved
            for link_id in moved:
                assert after[link_id] == (apply["id"], 0, *before[link_id][2:])
        untouched = {link_id: link for link_id, link in after.items() if link_id in before}
        changed = {link_id for link_id in untouched if untouched[link_id] != before[link_id]}
        origins = {apply["id"] for apply in graph["nodes"] if INSERTED_KEY in apply.get("properties", {})}
        assert all(after[link_id][0] in origins for link_id in changed)


def _without_inserted(doc):
    """The document without inserted Apply nodes and their links, with every link back at its loader, and the id
    counters as before: what the swap leaves of the original besides types and attribution."""
    doc = copy.deepcopy(doc)
    swap_loaders._remove_ui_apply_nodes(doc)
    return doc


def test_the_templates_package_has_minimax_workflows_with_loaders_in_subgraphs():
    with_loaders = [name for name, text in MINIMAX_TEMPLATES if _loader_paths(json.loads(text))]
    in_subgraphs = [name for name, text in MINIMAX_TEMPLATES
                    if any(where != "top" for where, _, _ in _loader_paths(json.loads(text)))]
    assert len(with_loaders) >= 4 and len(in_subgraphs) >= 3, (with_loaders, in_subgraphs)


@pytest.mark.parametrize("name,text", MINIMAX_TEMPLATES, ids=[name for name, _ in MINIMAX_TEMPLATES])
def test_every_stock_loader_of_every_minimax_template_is_swapped_and_reversed_exactly(name, text):
    original = json.loads(text)
    before = _loader_paths(original)
    swapped = copy.deepcopy(original)
    changed = swap_loaders.swap(swapped, version="9.9.9").swapped

    after = _loader_paths(swapped)
    assert len(changed) == sum(t in STOCK_TO_PACK for _, _, t in before)
    assert [(where, node_id, STOCK_TO_PACK.get(t, t)) for where, node_id, t in before] == after
    for node in changed:
        assert node["properties"]["cnr_id"] == "minimax-hotfix"
        assert node["properties"]["ver"] == "9.9.9"
        assert node["properties"]["Node name for S&R"] == node["type"]
    assert_rewired(original, swapped)
    assert _without_inserted(_without_attribution(swapped)) == _without_attribution(original)  # ids, widgets...

    swap_loaders.swap(swapped, reverse=True)
    assert json.dumps(swapped) == json.dumps(original)  # equal, key order included


CHANGED_TEMPLATES = [(name, text) for name, text in MINIMAX_TEMPLATES if swap_loaders.swap(json.loads(text))]


@pytest.mark.parametrize("name,text", CHANGED_TEMPLATES, ids=[name for name, _ in CHANGED_TEMPLATES])
def test_command_line_swap_then_reverse_gives_the_same_bytes(name, text, tmp_path):
    source = tmp_path / name
    source.write_text(text, encoding="utf-8")
    assert command_line.main([str(source)]) == 0
    swapped = tmp_path / name.replace(".json", ".minimax-hotfix.json")
    assert command_line.main([str(swapped), "--reverse", "-o", str(tmp_path / "back.json")]) == 0
    assert (tmp_path / "back.json").read_bytes() == source.read_bytes()
    assert source.read_text(encoding="utf-8") == text


def _node(node_id, node_type, properties=None, **extra):
    node = {"id": node_id, "type": node_type, "pos": [node_id * 10, 0], "widgets_values": [f"{node_type}.bin"]}
    if properties is not None:
        node["properties"] = properties
    node.update(extra)
    return node


def _core(node_type, ver="0.33.0"):
    return {"cnr_id": "comfy-core", "ver": ver, "Node name for S&R": node_type}


def test_nested_subgraphs_and_group_nodes_are_swapped():
    inner = {"id": "inner", "nodes": [_node(3, "VAELoader", _core("VAELoader"))], "links": []}
    outer = {"id": "outer", "nodes": [_node(2, "CLIPLoader", _core("CLIPLoader")), _node(9, "inner")], "links": [],
             "definitions": {"subgraphs": [inner]}}
    doc = {"nodes": [_node(1, "UNETLoader", _core("UNETLoader")), _node(8, "outer"), _node(7, "KSampler", _core("KSampler"))],
           "links": [], "definitions": {"subgraphs": [outer]},
           "extra": {"groupNodes": {"loaders": {"nodes": [_node(0, "VAELoader", _core("VAELoader"), index=0)]}}}}
    original = copy.deepcopy(doc)
    assert len(swap_loaders.swap(doc, version="1.0").swapped) == 4
    assert [n["type"] for n in swap_loaders.ui_nodes(doc)] == [
        "MiniMaxHotfixUNETLoader", "outer", "KSampler", "MiniMaxHotfixCLIPLoader", "inner", "MiniMaxHotfixVAELoader",
        "MiniMaxHotfixVAELoader"]
    swap_loaders.swap(doc, reverse=True)
    assert json.dumps(doc) == json.dumps(original)


def test_attribution_that_reverse_cannot_recompute_is_kept_and_restored():
    doc = {"nodes": [
        _node(1, "VAELoader", {"Node name for S&R": "VAELoader"}),  # written by an old frontend: no cnr_id, no ver
        _node(2, "CLIPLoader", _core("CLIPLoader", ver="0.30.1")),  # older than the rest of the workflow
        _node(3, "UNETLoader"),  # no properties at all
        _node(4, "UNETLoader", {"models": [{"name": "m.safetensors"}], **_core("UNETLoader")}),  # recomputable
        _node(5, "KSampler", _core("KSampler")), _node(6, "SaveImage", _core("SaveImage"))], "links": []}
    original = copy.deepcopy(doc)
    swap_loaders.swap(doc, version="0.1.0")
    kept = {node["id"]: node["properties"].get(ORIGINAL_KEY, "absent") for node in doc["nodes"][:4]}
    assert kept == {1: {"Node name for S&R": "VAELoader"}, 2: _core("CLIPLoader", ver="0.30.1"), 3: None, 4: "absent"}
    assert doc["nodes"][3]["properties"]["models"] == [{"name": "m.safetensors"}]
    swap_loaders.swap(doc, reverse=True)
    assert json.dumps(doc) == json.dumps(original)


def test_swapping_twice_changes_nothing_more():
    doc = {"nodes": [_node(1, "VAELoader", _core("VAELoader"))], "links": []}
    swap_loaders.swap(doc, version="0.1.0")
    once = copy.deepcopy(doc)
    assert not swap_loaders.swap(doc, version="0.1.0")
    assert doc == once


def test_reverse_of_a_workflow_built_with_the_pack_recomputes_the_core_attribution():
    doc = {"nodes": [_node(1, "MiniMaxHotfixVAELoader", {"cnr_id": "minimax-hotfix", "ver": "0.1.0",
                                                          "Node name for S&R": "MiniMaxHotfixVAELoader"}),
                     _node(2, "VAEDecode", _core("VAEDecode", ver="0.35.0"))], "links": []}
    swap_loaders.swap(doc, reverse=True)
    assert doc["nodes"][0]["type"] == "VAELoader"
    assert doc["nodes"][0]["properties"] == _core("VAELoader", ver="0.35.0")


def test_api_format_is_swapped_and_reversed_exactly():
    api = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "m.safetensors", "weight_dtype": "default"},
              "_meta": {"title": "Load Diffusion Model"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "t.safetensors", "type": "minimax"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": "v.safetensors"}},
        "4": {"class_type": "VAEDecode", "inputs": {"samples": ["9", 0], "vae": ["3", 0]}},
    }
    original = copy.deepcopy(api)
    assert len(swap_loaders.swap(api).swapped) == 3
    assert [node["class_type"] for node in api.values()] == [
        "MiniMaxHotfixUNETLoader", "MiniMaxHotfixCLIPLoader", "MiniMaxHotfixVAELoader", "VAEDecode"]
    assert [node["inputs"] for node in api.values()] == [node["inputs"] for node in original.values()]
    swap_loaders.swap(api, reverse=True)
    assert json.dumps(api) == json.dumps(original)


def test_pack_attribution_uses_the_version_of_pyproject_embedded_in_the_tool():
    pyproject = PACK_ROOT / "pyproject.toml"
    assert swap_loaders.VERSION == tomllib.loads(pyproject.read_text())["project"]["version"]
    doc = {"nodes": [_node(1, "CLIPLoader", _core("CLIPLoader"))], "links": []}
    swap_loaders.swap(doc)
    assert doc["nodes"][0]["properties"]["ver"] == swap_loaders.VERSION


def _not_stdlib_imports(path: Path, module_level_only: bool = False) -> set:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    imported = {alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
    return {name for name in imported if name.split(".")[0] not in sys.stdlib_module_names}


def test_the_swap_needs_only_the_standard_library():
    """The library imports nothing, not even of the pack; its command line only the library (through
    tools/minimax_hotfix, standard library only, never the pack's ComfyUI entry point)."""
    assert _not_stdlib_imports(PACK_ROOT / "swap_loaders.py") == set()
    assert _not_stdlib_imports(PACK_ROOT / "tools" / "minimax_hotfix" / "__init__.py") == set()
    assert _not_stdlib_imports(PACK_ROOT / "tools" / "doctor.py", module_level_only=True) == set()
    assert _not_stdlib_imports(TOOL) == {"minimax_hotfix.swap_loaders"}


# ---- command line ----

def _run(*args, cwd=None):
    return subprocess.run([sys.executable, "-I", str(TOOL), *map(str, args)], capture_output=True, text=True, cwd=cwd)


def _workflow_file(tmp_path, name="flow.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"nodes": [_node(1, "VAELoader", _core("VAELoader"))], "links": []}, indent=2) + "\n")
    return path


def test_command_line_writes_beside_the_input_and_leaves_the_input_alone(tmp_path):
    source = _workflow_file(tmp_path)
    before = source.read_bytes(), source.stat().st_mtime_ns
    result = _run(source)
    assert result.returncode == 0, result.stderr
    assert "1 x VAELoader -> MiniMaxHotfixVAELoader" in result.stderr
    assert (source.read_bytes(), source.stat().st_mtime_ns) == before
    assert json.loads((tmp_path / "flow.minimax-hotfix.json").read_text())["nodes"][0]["type"] == "MiniMaxHotfixVAELoader"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flow.json", "flow.minimax-hotfix.json"]  # no temp files


def test_command_line_refuses_to_overwrite_the_input_without_in_place(tmp_path):
    source = _workflow_file(tmp_path)
    before = source.read_bytes()
    result = _run(source, "-o", source)
    assert result.returncode == 2 and "--in-place" in result.stderr
    assert source.read_bytes() == before
    assert _run(source, "--in-place").returncode == 0
    assert json.loads(source.read_text())["nodes"][0]["type"] == "MiniMaxHotfixVAELoader"
    assert _run(source, "--in-place", "--reverse").returncode == 0
    assert source.read_bytes() == before


def test_command_line_to_standard_output(tmp_path):
    result = _run(_workflow_file(tmp_path), "-o", "-")
    assert result.returncode == 0
    assert json.loads(result.stdout)["nodes"][0]["type"] == "MiniMaxHotfixVAELoader"


@pytest.mark.parametrize("content,message", [
    ('{"nodes": [1, 2,]}', "malformed JSON at line 1 column 17"),
    ("", "malformed JSON at line 1 column 1"),
    ("[1, 2]", "unrecognised format"),
    ('{"last_node_id": 3}', "unrecognised format"),
    ('{"1": {"inputs": {}}}', "unrecognised format"),
    ('{"nodes": [{"id": 1}]}', 'malformed UI workflow: node 1: "type" is null, expected a string'),
    ('{"nodes": [{"id": 7, "type": "VAELoader", "properties": null}]}',
     'malformed UI workflow: node 7: "properties" is null, expected an object'),
])
def test_command_line_fails_clearly_on_bad_input(tmp_path, content, message):
    source = tmp_path / "bad.json"
    source.write_text(content)
    result = _run(source)
    assert result.returncode == 1
    assert result.stderr.startswith(f"swap_loaders: error: {source}: ") and message in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_command_line_names_a_missing_file(tmp_path):
    result = _run(tmp_path / "nowhere.json")
    assert result.returncode == 1 and "nowhere.json: cannot read" in result.stderr


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = _workflow_file(tmp_path)
    before = target.read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    assert command_line.main([str(target), "--in-place"]) == 1
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["flow.json"]


def test_layout_of_the_input_is_kept(tmp_path):
    doc = {"nodes": [_node(1, "VAELoader", {"cnr_id": "comfy-core", "ver": "0.33.0", "Node name for S&R": "VAELoader",
                                            "note": "données"})], "links": []}
    for name, text in [("compact.json", json.dumps(doc, separators=(",", ":"), ensure_ascii=False)),
                       ("tabs.json", json.dumps(doc, indent="\t", ensure_ascii=False) + "\n"),
                       ("ascii.json", json.dumps(doc, indent=4))]:
        source = tmp_path / name
        source.write_text(text, encoding="utf-8")
        assert command_line.main([str(source), "-o", str(tmp_path / "s.json")]) == 0
        assert command_line.main([str(tmp_path / "s.json"), "--reverse", "-o", str(tmp_path / "r.json")]) == 0
        assert (tmp_path / "r.json").read_text(encoding="utf-8") == text, name


# ---- Apply nodes after other loaders ----

@pytest.mark.parametrize("build,expected", [
    (music3_gguf, {"MiniMaxHotfixApplyCLIP": "CLIPLoaderGGUFDynamicVRAM"}),
    (music3_checkpoint, {"MiniMaxHotfixApplyModel": "CheckpointLoaderSimple",
                         "MiniMaxHotfixApplyCLIP": "CheckpointLoaderSimple",
                         "MiniMaxHotfixApplyVAE": "CheckpointLoaderSimple"}),
], ids=["CLIPLoaderGGUFDynamicVRAM", "CheckpointLoaderSimple"])
def test_other_loaders_get_the_apply_node_with_every_consumer_rewired(build, expected):
    original = build()
    swapped = copy.deepcopy(original)
    changes = swap_loaders.swap(swapped)
    assert {apply["type"]: source["type"] for apply, source in changes.inserted} == expected
    assert_rewired(original, swapped)
    assert swapped["last_node_id"] == original["last_node_id"] + len(expected)
    assert swapped["last_link_id"] == original["last_link_id"] + len(expected)
    for apply, _ in changes.inserted:
        assert apply["properties"]["cnr_id"] == "minimax-hotfix" and apply["properties"]["ver"] == swap_loaders.VERSION
    assert not swap_loaders.swap(copy.deepcopy(swapped)), "a second swap changes nothing"
    reverse = swap_loaders.swap(swapped, reverse=True)
    assert len(reverse.removed) == len(expected) and not reverse.kept
    assert json.dumps(swapped) == json.dumps(original)


def _subgraph_workflow():
    """A GGUF loader inside a subgraph whose CLIP leaves through the subgraph's output and feeds an inner node."""
    inner = {"id": "sub-1", "state": {"lastNodeId": 5, "lastLinkId": 4}, "nodes": [
        {"id": 3, "type": "CLIPLoaderGGUF", "pos": [0, 0], "size": [300, 80], "inputs": [],
         "outputs": [{"name": "CLIP", "type": "CLIP", "links": [2, 3]}], "widgets_values": ["t.gguf", "minimax"]},
        {"id": 4, "type": "MiniMaxMusic3TextEncode", "inputs": [{"name": "clip", "type": "CLIP", "link": 3}],
         "outputs": []}],
        "links": [{"id": 2, "origin_id": 3, "origin_slot": 0, "target_id": -20, "target_slot": 0, "type": "CLIP"},
                  {"id": 3, "origin_id": 3, "origin_slot": 0, "target_id": 4, "target_slot": 0, "type": "CLIP"}],
        "outputs": [{"name": "CLIP", "type": "CLIP", "linkIds": [2]}]}
    return {"last_node_id": 5, "last_link_id": 4, "nodes": [
        {"id": 1, "type": "sub-1", "inputs": [], "outputs": [{"name": "CLIP", "type": "CLIP", "links": [1]}]},
        {"id": 5, "type": "CLIPTextEncode", "inputs": [{"name": "clip", "type": "CLIP", "link": 1}], "outputs": []}],
        "links": [[1, 1, 0, 5, 0, "CLIP"]], "definitions": {"subgraphs": [inner]}, "version": 0.4}


def test_inside_a_subgraph_the_apply_node_feeds_the_subgraph_output_too():
    original = _subgraph_workflow()
    doc = copy.deepcopy(original)
    changes = swap_loaders.swap(doc)
    ((apply, source),) = changes.inserted
    assert source["id"] == 3 and apply["id"] == 6, "ids are unique across the root graph and its subgraphs"
    assert_rewired(original, doc)
    inner = doc["definitions"]["subgraphs"][0]
    assert inner["links"][-1] == {"id": 5, "origin_id": 3, "origin_slot": 0, "target_id": 6, "target_slot": 0,
                                  "type": "CLIP"}
    assert inner["state"] == {"lastNodeId": 6, "lastLinkId": 5} and doc["last_node_id"] == 6
    assert doc["nodes"][0]["type"] == "sub-1", "the subgraph node itself gets no Apply node"
    swap_loaders.swap(doc, reverse=True)
    assert json.dumps(doc) == json.dumps(original)


def test_an_output_already_going_through_the_apply_node_is_left_alone():
    workflow = json.loads((PACK_ROOT / "workflows" / "MiniMax Music 3 with a GGUF text encoder.json").read_text())
    assert not swap_loaders.swap(copy.deepcopy(workflow)).inserted


def test_reverse_of_a_workflow_the_tool_did_not_write_names_the_pack_nodes_it_keeps(tmp_path):
    source = tmp_path / "gguf.json"
    shutil.copy(PACK_ROOT / "workflows" / "MiniMax Music 3 with a GGUF text encoder.json", source)
    result = _run(source, "--reverse")
    assert result.returncode == 0
    assert ("kept, not inserted by this tool: node 3 (MiniMaxHotfixApplyCLIP), node 5 (MiniMaxHotfixStatus)"
            in result.stderr)


def test_api_format_loaders_get_the_apply_node_and_unknown_loaders_a_warning():
    api = {
        "1": {"inputs": {"ckpt_name": "all.safetensors"}, "class_type": "CheckpointLoaderSimple"},
        "2": {"inputs": {"clip_name": "t.gguf", "type": "minimax"}, "class_type": "CLIPLoaderGGUF"},
        "3": {"inputs": {"clip": ["2", 0], "text": "x"}, "class_type": "CLIPTextEncode"},
        "4": {"inputs": {"model": ["1", 0], "positive": ["3", 0], "vae": ["1", 2]}, "class_type": "Sampler"},
        "5": {"inputs": {"name": "x"}, "class_type": "SomeThirdPartyLoader"},
        "6": {"inputs": {"model": ["5", 0]}, "class_type": "ModelSamplingSD3"},
        "7": {"inputs": {"model": ["6", 0]}, "class_type": "KSampler"},
    }
    original = copy.deepcopy(api)
    changes = swap_loaders.swap(api)
    assert [(apply["id"], apply["class_type"], source["id"]) for apply, source in changes.inserted] == [
        ("8", "MiniMaxHotfixApplyModel", "1"), ("9", "MiniMaxHotfixApplyVAE", "1"), ("10", "MiniMaxHotfixApplyCLIP", "2")]
    assert api["4"]["inputs"] == {"model": ["8", 0], "positive": ["3", 0], "vae": ["9", 0]}
    assert api["3"]["inputs"]["clip"] == ["10", 0] and api["10"]["inputs"] == {"clip": ["2", 0]}
    assert changes.warnings == [
        "node 5 (SomeThirdPartyLoader) feeds model but its output types are unknown in API format: if it loads a "
        "model, run the tool on the UI-format workflow or put the matching MiniMaxHotfixApply node after it by hand"]
    assert api["6"]["inputs"] == {"model": ["5", 0]}, "ModelSamplingSD3 passes a model on: no warning, no change"
    swap_loaders.swap(api, reverse=True)
    assert json.dumps(api) == json.dumps(original)


def test_rules_module_is_the_committed_web_swap_rules_js():
    committed = (PACK_ROOT / "web" / "swap_rules.js").read_text(encoding="utf-8")
    assert committed == swap_loaders.rules_module(), "regenerate: python tools/swap_loaders.py --print-rules > web/swap_rules.js"
    assert _run("--print-rules").stdout == committed


# ---- safe writes and the command line ----

def test_check_reports_and_writes_nothing(tmp_path):
    source = _workflow_file(tmp_path)
    result = _run("--check", source)
    assert result.returncode == 1
    assert result.stderr == f"swap_loaders: {source}: would change: 1 x VAELoader -> MiniMaxHotfixVAELoader\n"
    assert [p.name for p in tmp_path.iterdir()] == ["flow.json"]
    _run(source, "--in-place")
    assert _run("--check", source).returncode == 0


def test_several_files_in_one_run_and_one_bad_file_does_not_stop_the_others(tmp_path):
    first, second = _workflow_file(tmp_path, "a.json"), _workflow_file(tmp_path, "b.json")
    bad = tmp_path / "c.json"
    bad.write_text("{")
    result = _run(first, bad, second, "--in-place")
    assert result.returncode == 1
    assert [json.loads(p.read_text())["nodes"][0]["type"] for p in (first, second)] == ["MiniMaxHotfixVAELoader"] * 2
    assert all(line.startswith("swap_loaders: ") for line in result.stderr.splitlines())


def test_version():
    result = _run("--version")
    assert result.returncode == 0 and result.stdout == f"swap_loaders {swap_loaders.VERSION} (MiniMax Hotfix)\n"


def test_in_place_writes_through_a_symlink_to_its_target(tmp_path):
    target = _workflow_file(tmp_path)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert _run(link, "--in-place").returncode == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["nodes"][0]["type"] == "MiniMaxHotfixVAELoader"


def test_in_place_keeps_mode_and_owner(tmp_path):
    target = _workflow_file(tmp_path)
    os.chmod(target, 0o640)
    owner = (target.stat().st_uid, target.stat().st_gid)
    if os.getuid() == 0:
        owner = (1234, 5678)  # as root, a user's file: it must stay theirs
        os.chown(target, *owner)
    assert _run(target, "--in-place").returncode == 0
    after = target.stat()
    assert stat.S_IMODE(after.st_mode) == 0o640 and (after.st_uid, after.st_gid) == owner


def test_in_place_refuses_a_read_only_file_without_force(tmp_path):
    target = _workflow_file(tmp_path)
    os.chmod(target, 0o444)
    before = target.read_bytes()
    result = _run(target, "--in-place")
    assert result.returncode == 1
    assert result.stderr == f"swap_loaders: error: {target}: the file is read-only; pass --force to replace it anyway\n"
    assert target.read_bytes() == before
    assert _run(target, "--in-place", "--force").returncode == 0
    assert stat.S_IMODE(target.stat().st_mode) == 0o444 and target.read_bytes() != before


def test_nothing_to_change_writes_nothing(tmp_path):
    target = _workflow_file(tmp_path)
    _run(target, "--in-place")
    before = target.read_bytes(), target.stat().st_mtime_ns, target.stat().st_ino
    result = _run(target, "--in-place")
    assert result.returncode == 0 and result.stderr == f"swap_loaders: {target}: nothing to change; wrote nothing\n"
    assert (target.read_bytes(), target.stat().st_mtime_ns, target.stat().st_ino) == before


def test_write_errors_name_the_file_the_user_gave(tmp_path):
    source = _workflow_file(tmp_path)
    result = _run(source, "-o", tmp_path / "no" / "out.json")
    assert result.returncode == 1
    assert result.stderr == (f"swap_loaders: error: {tmp_path / 'no' / 'out.json'}: cannot write: folder "
                             f"{tmp_path / 'no'} does not exist\n")
    assert ".tmp" not in result.stderr


def test_usage_errors_have_the_same_prefix(tmp_path):
    result = _run()
    assert result.returncode == 2 and "swap_loaders: error: no FILE given" in result.stderr
    result = _run(_workflow_file(tmp_path, "a.json"), _workflow_file(tmp_path, "b.json"), "-o", "x.json")
    assert result.returncode == 2 and "swap_loaders: error: -o/--output takes one FILE" in result.stderr


def test_the_command_line_loads_the_swap_alone_from_any_folder(tmp_path):
    """Run from elsewhere (``python -I``: neither the working folder nor tools/ on the path), the tool loads the
    pack's swap_loaders.py and nothing else of the pack: not its ComfyUI entry point, no torch."""
    source = _workflow_file(tmp_path)
    code = (f"import runpy, sys\nsys.argv = [{str(TOOL)!r}, {str(source)!r}, '-o', '-']\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as done:\n"
            "    assert done.code == 0, done.code\n"
            "print(sorted(name for name in sys.modules if name.split('.')[0] in ('minimax_hotfix', 'torch', 'comfy')),"
            " file=sys.stderr)\n")
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["nodes"][0]["properties"]["ver"] == swap_loaders.VERSION
    assert result.stderr.splitlines()[-1] == "['minimax_hotfix', 'minimax_hotfix.swap_loaders']", result.stderr


def test_only_one_node_is_swapped_when_asked():
    workflow = music3_checkpoint()
    loader = next(node for node in workflow["nodes"] if node["type"] == "CheckpointLoaderSimple")
    vae = {"id": 99, "type": "VAELoader", "properties": _core("VAELoader"), "outputs": []}
    workflow["nodes"].append(vae)
    changes = swap_loaders.swap(workflow, only={"graph": None, "node": 99})
    assert changes.swapped == [vae] and not changes.inserted
    changes = swap_loaders.swap(workflow, only={"graph": None, "node": str(loader["id"])})  # as the frontend names it
    assert len(changes.inserted) == 3 and not changes.swapped
    with pytest.raises(swap_loaders.WorkflowError, match="no node 5 in graph sub"):
        swap_loaders.swap(workflow, only={"graph": "sub", "node": 5})


# ---- what ComfyUI's frontend opens (issue 31) ----
# Each workflow here passes the workflow schema of the frontend ComfyUI 0.33.0 pins (comfyui-frontend-package 1.49.6,
# src/platform/workflow/validation/schemas/workflowSchema.ts; the line of each rule is named), so the swap must take
# it, and the reverse must give it back exactly. tests/test_swap_loaders_fuzz.py draws many more from the schema.

FRONTEND_WORKFLOWS = Path(__file__).with_name("frontend_workflows")


def test_a_widget_input_typed_by_its_option_list_is_swapped_and_reversed_exactly(tmp_path):
    """The issue's workflow: VHS_VideoCombine's ``format`` input carries its options as its type (zDataType, line 39:
    a string, a list of strings or a number) and its widget values are an object (zWidgetValues, line 213). The tool
    refused it: ``node 133: "inputs"[7].type is a list, expected a string``."""
    source, swapped, back = tmp_path / "vhs.json", tmp_path / "swapped.json", tmp_path / "back.json"
    shutil.copy(FRONTEND_WORKFLOWS / "vhs_video_combine_format_list.json", source)
    result = _run(source, "-o", swapped)
    assert result.returncode == 0, result.stderr
    assert result.stderr == f"swap_loaders: {source}: 1 x VAELoader -> MiniMaxHotfixVAELoader; wrote {swapped}\n"
    original_nodes, swapped_nodes = json.loads(source.read_text())["nodes"], json.loads(swapped.read_text())["nodes"]
    assert swapped_nodes[1:] == original_nodes[1:], "VAEDecode and VHS_VideoCombine are left as they are"
    assert _run(swapped, "--reverse", "-o", back).returncode == 0
    assert back.read_bytes() == source.read_bytes()


def _frontend_node(node_id, node_type, inputs=(), outputs=(), **fields):
    """A node with every key the schema requires of one (zComfyNode, line 215)."""
    return {"id": node_id, "type": node_type, "pos": [100, 0], "size": [300, 80], "flags": {}, "order": 0, "mode": 0,
            "inputs": list(inputs), "outputs": list(outputs), "properties": _core(node_type), "widgets_values": [],
            **fields}


def _frontend_workflow(nodes, links, **fields):
    """Schema 0.4 (zComfyWorkflow, line 328): links as arrays, the id counters at the top level."""
    return {"last_node_id": 3, "last_link_id": 2, "nodes": nodes, "links": links, "groups": [], "config": {},
            "extra": {}, "version": 0.4, **fields}


def _gguf_to_encoder(loader_id=1, encoder_id=2, link_id=1, origin_slot=0, target_slot=0, **loader_fields):
    """CLIPLoaderGGUF feeding CLIPTextEncode: the swap inserts MiniMaxHotfixApplyCLIP between them."""
    return [_frontend_node(loader_id, "CLIPLoaderGGUF", outputs=[{"name": "CLIP", "type": "CLIP", "links": [link_id]}],
                           **loader_fields),
            _frontend_node(encoder_id, "CLIPTextEncode", inputs=[{"name": "clip", "type": "CLIP", "link": link_id}])], \
        [[link_id, loader_id, origin_slot, encoder_id, target_slot, "CLIP"]]


OPTIONS = ["a.safetensors", "b.safetensors"]
GROUP_NODE_VAE = {key: value for key, value in _frontend_node(0, "VAELoader", index=1).items() if key != "id"}
FRONTEND_CASES = [  # (name, workflow, the swap's summary, fields of the inserted Apply node)
    ("a converted combo and its link typed by the options (zDataType, line 39)", _frontend_workflow([
        _frontend_node(1, "PrimitiveNode", outputs=[{"name": "COMBO", "type": OPTIONS, "links": [1],
                                                     "widget": {"name": "ckpt_name"}}]),
        _frontend_node(2, "CheckpointLoaderSimple", inputs=[{"name": "ckpt_name", "type": OPTIONS, "link": 1,
                                                             "widget": {"name": "ckpt_name"}}],
                       outputs=[{"name": "MODEL", "type": "MODEL", "links": [2]}]),
        _frontend_node(3, "KSampler", inputs=[{"name": "model", "type": "MODEL", "link": 2}])],
        [[1, 1, 0, 2, 0, OPTIONS], [2, 2, 0, 3, 0, "MODEL"]]),
     "inserted MiniMaxHotfixApplyModel after CheckpointLoaderSimple (node 2)", {"id": 4}),
    ("comma-joined and numeric types (zDataType, line 39)", _frontend_workflow([
        _frontend_node(1, "VAELoader", outputs=[{"name": "VAE", "type": "VAE", "links": None}]),
        _frontend_node(2, "ImageBlend", inputs=[{"name": "image", "type": "IMAGE,MASK", "link": None},
                                                {"name": "legacy", "type": 3, "link": None}])], []),
     "1 x VAELoader -> MiniMaxHotfixVAELoader", None),
    ("slot numbers as strings (zSlotIndex, line 26)", _frontend_workflow(*_gguf_to_encoder(
        origin_slot="0", target_slot="0")), "inserted MiniMaxHotfixApplyCLIP after CLIPLoaderGGUF (node 1)",
     {"id": 4, "properties": {"cnr_id": "minimax-hotfix", "ver": swap_loaders.VERSION,
                              "Node name for S&R": "MiniMaxHotfixApplyCLIP", INSERTED_KEY: {
                                  "after": [1, 0], "counters": {"root": [3, 2]}, "origins": {"1": [1, "0"]}}}}),
    ("a node id written 4.0 and fractional link ids (zNodeId, line 15; zComfyLink, line 68)", _frontend_workflow(
        *_gguf_to_encoder(loader_id=4.0, link_id=2.5), last_node_id=4, last_link_id=2.5),
     "inserted MiniMaxHotfixApplyCLIP after CLIPLoaderGGUF (node 4.0)", {"id": 5, "inputs": [
         {"localized_name": "clip", "name": "clip", "type": "CLIP", "link": 3}]}),
    ("node ids and last_node_id as strings (zNodeId, line 15; last_node_id, line 332)", _frontend_workflow(
        *_gguf_to_encoder(loader_id="1", encoder_id="2"), last_node_id="12"),
     "inserted MiniMaxHotfixApplyCLIP after CLIPLoaderGGUF (node 1)", {"id": 13}),
    ("null where the schema allows it (lines 114, 123, 338, 339)", _frontend_workflow([
        _frontend_node(1, "UNETLoader", outputs=[{"name": "MODEL", "type": "MODEL", "links": None}]),
        _frontend_node(2, "KSampler", inputs=[{"name": "model", "type": "MODEL", "link": None}])], [],
        config=None, extra=None), "1 x UNETLoader -> MiniMaxHotfixUNETLoader", None),
    ("keys the schema does not name (.passthrough())", _frontend_workflow(
        *_gguf_to_encoder(title="Text encoder", shape=1, color="#322"), ds_note="x",
        extra={"ds": {"scale": 1.2, "offset": [5, 5]}, "VHS_latentpreview": False}),
     "inserted MiniMaxHotfixApplyCLIP after CLIPLoaderGGUF (node 1)", {"id": 4}),
    ("a legacy group node's inner node without a type (groupNode.ts, lines 69 and 777)", _frontend_workflow(
        [_frontend_node(1, "workflow>loaders")], [], extra={"groupNodes": {"loaders": {
            "nodes": [{"index": 0, "pos": [0, 0], "size": [300, 80], "flags": {}, "order": 0, "mode": 0,
                       "properties": {}}, GROUP_NODE_VAE], "links": [], "external": []}}}),
     "1 x VAELoader -> MiniMaxHotfixVAELoader", None),
    ("positions and the canvas offset as {\"0\", \"1\"} objects (zVector2, line 41; zDS, line 270)",
     _frontend_workflow(*_gguf_to_encoder(pos={"0": 100, "1": 50}, size={"0": 300, "1": 80}),
                        extra={"ds": {"scale": 1, "offset": {"0": -20, "1": 10}}}),
     "inserted MiniMaxHotfixApplyCLIP after CLIPLoaderGGUF (node 1)", {"pos": [430, 50]}),
    ("schema 1: links as objects, the counters in state (zComfyWorkflow1, line 380)", {
        "version": 1, "state": {"lastGroupId": 0, "lastNodeId": 2, "lastLinkId": 1, "lastRerouteId": 0},
        "nodes": _gguf_to_encoder()[0], "links": [{"id": 1, "origin_id": 1, "origin_slot": 0, "target_id": 2,
                                                   "target_slot": 0, "type": "CLIP", "parentId": 3}],
        "reroutes": [{"id": 3, "pos": [200, 0], "linkIds": [1]}], "extra": {}},
     "inserted MiniMaxHotfixApplyCLIP after CLIPLoaderGGUF (node 1)", {"id": 3}),
]


@pytest.mark.parametrize("name,doc,summary,apply_fields", FRONTEND_CASES, ids=[case[0] for case in FRONTEND_CASES])
def test_what_the_frontend_opens_is_swapped_and_reversed_exactly(name, doc, summary, apply_fields):
    swapped = copy.deepcopy(doc)
    changes = swap_loaders.swap(swapped)
    assert changes.summary(reverse=False) == summary
    if apply_fields:
        ((apply, _),) = changes.inserted
        assert {key: apply[key] for key in apply_fields} == apply_fields
    swap_loaders.validate(swapped)
    swap_loaders.swap(swapped, reverse=True)
    assert json.dumps(swapped) == json.dumps(doc)


FILE_AND_PROCESS_NAMES = {"os", "tempfile", "shutil", "stat", "pathlib", "Path", "open", "umask", "chdir", "environ"}


def file_and_process_names(source: str) -> list[str]:
    """The names in ``source`` that handle files or change process-wide state."""
    tree = ast.parse(source)
    found = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                         if isinstance(node, ast.ImportFrom) and node.module}
    found |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    found |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    return sorted(found & FILE_AND_PROCESS_NAMES)


def test_the_library_the_server_imports_handles_no_files_and_no_process_state():
    library = (Path(swap_loaders.__file__)).read_text(encoding="utf-8")
    assert file_and_process_names(library) == []
    # red control: the library as it was, with the command line's atomic writes and its umask read in it
    assert file_and_process_names("import os, tempfile\ndef _umask():\n    current = os.umask(0)\n") == \
        ["os", "tempfile", "umask"]


def test_a_new_file_gets_the_mode_every_new_file_gets(tmp_path):
    """0o666 less the umask, which the system applies: the tool never sets the umask to read it (a race in a
    threaded process, where other threads create files meanwhile)."""
    source = tmp_path / "flow.json"
    source.write_text(json.dumps({"nodes": [{"id": 1, "type": "VAELoader"}], "links": []}))
    previous = os.umask(0o027)
    try:
        assert command_line.main([str(source), "-o", str(tmp_path / "out.json")]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "out.json").stat().st_mode) == 0o640


# ---- raylight (multi-GPU MiniMax H3): its loaders hand on Ray actors ----

needs_raylight = pytest.mark.skipif(not raylight_source.available(), reason="needs ../shared/raylight (raylight's source)")


@needs_raylight
def test_the_raylight_loaders_of_the_table_are_raylights_ray_actor_loaders():
    """The API-format table gives raylight 1.9.0's diffusion-model loaders the outputs their code declares (ComfyUI's
    test server has no raylight to ask, as it has for the core loaders)."""
    returns = raylight_source.node_return_types()
    assert {name: returns[name] for name in swap_loaders.RAYLIGHT_LOADERS} == {
        name: swap_loaders.API_LOADER_OUTPUTS[name] for name in swap_loaders.RAYLIGHT_LOADERS}


@needs_raylight
@pytest.mark.parametrize("name", ["Minimax_H3_I2V_Raylight.json", "Minimax_H3_REF2VA_Raylight.json"])
def test_raylights_minimax_h3_workflows_get_the_ray_actors_apply_node_after_its_loader(name):
    """raylight's own MiniMax H3 example workflows: the Apply (Ray actors) node goes right after RayUNETLoader, every
    node that took its actors takes them from the Apply node, and the reverse gives the original back exactly. Red
    control: without the rule for RAY_ACTORS nothing reaches the actors."""
    original = json.loads((raylight_source.RAYLIGHT / "example_workflows" / name).read_text(encoding="utf-8"))
    swapped = copy.deepcopy(original)
    changes = swap_loaders.swap(swapped)
    inserted = [(apply_node["type"], after["type"]) for apply_node, after in changes.inserted]
    assert inserted == [("MiniMaxHotfixApplyRayActors", "RayUNETLoader")]
    assert_rewired(original, swapped)
    swap_loaders.swap(swapped, reverse=True)
    assert json.dumps(swapped) == json.dumps(original)

    without_rule = {io_type: entry for io_type, entry in swap_loaders.APPLY_NODE.items() if io_type != "RAY_ACTORS"}
    unfixed = copy.deepcopy(original)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(swap_loaders, "APPLY_NODE", without_rule)
        assert not swap_loaders.swap(unfixed).inserted
