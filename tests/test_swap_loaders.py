"""tools/swap_loaders.py: swaps every stock loader (subgraphs, group nodes and API format included), changes
nothing else, reverses exactly, writes atomically, never overwrites its input unless told to, and fails clearly."""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "swap_loaders.py"
sys.path.insert(0, str(TOOL.parent))
import swap_loaders  # noqa: E402
from swap_loaders import ATTRIBUTION_KEYS, ORIGINAL_KEY, PACK_TO_STOCK, STOCK_TO_PACK  # noqa: E402

TEMPLATES = resources.files("comfyui_workflow_templates_json") / "templates"
MINIMAX_NODE_PREFIXES = ("MiniMaxH3", "EmptyMiniMax", "MiniMaxMusic3")


def _minimax_templates():
    """Every UI-format template whose name says MiniMax or that uses a MiniMax node, at any depth."""
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
    return found


MINIMAX_TEMPLATES = _minimax_templates()


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
    changed = swap_loaders.swap(swapped, version="9.9.9")

    after = _loader_paths(swapped)
    assert len(changed) == sum(t in STOCK_TO_PACK for _, _, t in before)
    assert [(where, node_id, STOCK_TO_PACK.get(t, t)) for where, node_id, t in before] == after
    for node in changed:
        assert node["properties"]["cnr_id"] == "minimax-hotfix"
        assert node["properties"]["ver"] == "9.9.9"
        assert node["properties"]["Node name for S&R"] == node["type"]
    assert _without_attribution(swapped) == _without_attribution(original)  # ids, links, widgets, models...

    swap_loaders.swap(swapped, reverse=True)
    assert json.dumps(swapped) == json.dumps(original)  # equal, key order included


@pytest.mark.parametrize("name,text", MINIMAX_TEMPLATES[:4], ids=[name for name, _ in MINIMAX_TEMPLATES[:4]])
def test_command_line_swap_then_reverse_gives_the_same_bytes(name, text, tmp_path):
    source = tmp_path / name
    source.write_text(text, encoding="utf-8")
    assert swap_loaders.main([str(source)]) == 0
    swapped = tmp_path / name.replace(".json", ".minimax-hotfix.json")
    assert swap_loaders.main([str(swapped), "--reverse", "-o", str(tmp_path / "back.json")]) == 0
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
    assert len(swap_loaders.swap(doc, version="1.0")) == 4
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
    assert swap_loaders.swap(doc, version="0.1.0") == []
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
    assert len(swap_loaders.swap(api)) == 3
    assert [node["class_type"] for node in api.values()] == [
        "MiniMaxHotfixUNETLoader", "MiniMaxHotfixCLIPLoader", "MiniMaxHotfixVAELoader", "VAEDecode"]
    assert [node["inputs"] for node in api.values()] == [node["inputs"] for node in original.values()]
    swap_loaders.swap(api, reverse=True)
    assert json.dumps(api) == json.dumps(original)


def test_pack_attribution_uses_the_pyproject_version():
    pyproject = TOOL.parents[1] / "pyproject.toml"
    assert swap_loaders.pack_version() == tomllib.loads(pyproject.read_text())["project"]["version"]
    doc = {"nodes": [_node(1, "CLIPLoader", _core("CLIPLoader"))], "links": []}
    swap_loaders.swap(doc)
    assert doc["nodes"][0]["properties"]["ver"] == swap_loaders.pack_version()


def test_the_tool_needs_only_the_standard_library():
    tree = ast.parse(TOOL.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names)


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
    ('{"nodes": [{"id": 1}]}', 'a node without a "type"'),
    ('{"nodes": [{"id": 7, "type": "VAELoader", "properties": null}]}', 'node 7 has "properties" that is not an object'),
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
    assert swap_loaders.main([str(target), "--in-place"]) == 1
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
        assert swap_loaders.main([str(source), "-o", str(tmp_path / "s.json")]) == 0
        assert swap_loaders.main([str(tmp_path / "s.json"), "--reverse", "-o", str(tmp_path / "r.json")]) == 0
        assert (tmp_path / "r.json").read_text(encoding="utf-8") == text, name
