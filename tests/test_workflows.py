"""The bundled example workflows (workflows/*.json) are sound ComfyUI workflows.

Without ComfyUI (CI): every node type exists and every widget value fits its input, checked against
tests/workflow_node_specs.json, a snapshot of ComfyUI 0.33.0's /object_info for the node types the workflows (and
the official templates that tests/test_official_templates_on_device.py runs) use (interfaces only); subgraphs are
lowered as the frontend queues them (one template's and a nested case checked). With COMFYUI_PATH: the same checks against a live ComfyUI started with this pack, the snapshot is
compared with it (MINIMAX_HOTFIX_UPDATE_SPECS=1 rewrites it), ComfyUI lists the workflows at /workflow_templates and
serves each with its thumbnail, and each workflow, converted to API format, passes /prompt validation except for the
model files that the test ComfyUI does not have. ComfyUI-GGUF's text encoder loaders are a stand-in custom node of
the tests (tests/comfyui_gguf_stand_in: same inputs), so the GGUF workflow is validated without that pack.
"""

from __future__ import annotations

import copy
import json
import os
import re
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

PACK_ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((PACK_ROOT / "workflows").glob("*.json"))
SPECS_FILE = Path(__file__).with_name("workflow_node_specs.json")
from hotfix_testing.comfyui_server import STAND_INS, comfyui_with_pack, http  # noqa: E402
from hotfix_testing.user_workflows import music3_checkpoint, music3_gguf  # noqa: E402
from hotfix_testing.workflow_api import (  # noqa: E402
    FOLDER_LISTED_INPUTS,
    FRONTEND_ONLY,
    MODEL_FILE_INPUTS,
    OFFICIAL_TEMPLATES,
    load,
    official_template,
    ui_to_api,
)
from hotfix_testing.workflow_fuzzing import examples, json_values, workflows  # noqa: E402
from minimax_hotfix import swap_loaders

PACK_LOADERS = set(swap_loaders.PACK_TO_STOCK)
THUMBNAIL_MAX_BYTES = 30 * 1024
MODEL_URL = "https://huggingface.co/Comfy-Org/"


def node_specs() -> dict:
    return load(SPECS_FILE)["nodes"]


def check_workflow(workflow: dict, specs: dict) -> dict:
    """Node types exist, widgets fit, links are consistent, required inputs are connected; returns the API prompt."""
    unknown = {node["type"] for node in workflow["nodes"]} - set(specs) - FRONTEND_ONLY
    assert not unknown, f"node types that do not exist: {sorted(unknown)}"
    nodes = {node["id"]: node for node in workflow["nodes"]}
    for link_id, origin, origin_slot, target, target_slot, link_type in workflow["links"]:
        output, target_input = nodes[origin]["outputs"][origin_slot], nodes[target]["inputs"][target_slot]
        assert link_id in output["links"] and target_input["link"] == link_id, f"link {link_id}: ends disagree"
        assert output["type"] == link_type == target_input["type"], (
            f"link {link_id}: {output['type']} output, {link_type} link, {target_input['type']} input")
    link_ids = {link[0] for link in workflow["links"]}
    dangling = [(node["id"], slot["name"]) for node in workflow["nodes"] for slot in node.get("inputs", [])
                if slot.get("link") is not None and slot["link"] not in link_ids]
    assert not dangling, f"inputs pointing at links that do not exist: {dangling}"
    prompt = ui_to_api(workflow, specs)
    for node_id, node in prompt.items():
        spec = specs[node["class_type"]]
        for name in spec["input"].get("required", {}):
            assert name in node["inputs"], f"node {node_id} ({node['class_type']}): required input {name} not connected"
        outputs = [output["type"] for output in nodes[int(node_id)]["outputs"]]
        assert outputs == spec["output"], f"node {node_id}: outputs {outputs} != {spec['output']}"
    return prompt


@pytest.fixture(scope="module")
def snapshot_specs():
    return node_specs()


def test_there_are_the_five_workflows():
    assert sorted(path.stem for path in WORKFLOWS) == [
        "MiniMax H3 image to video", "MiniMax H3 reference to video (Ref2VA)", "MiniMax H3 text to video",
        "MiniMax Music 3", "MiniMax Music 3 with a GGUF text encoder"]


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_node_types_exist_and_widget_values_fit(path, snapshot_specs):
    prompt = check_workflow(load(path), snapshot_specs)
    assert any(node["class_type"] == "MiniMaxHotfixStatus" for node in prompt.values())


@pytest.mark.parametrize("break_it,error", [
    (lambda wf: wf["nodes"][0].update(type="NoSuchNode"), "node types that do not exist"),
    (lambda wf: _first(wf, "MiniMaxHotfixCLIPLoader")["widgets_values"].__setitem__(1, "not_a_type"), "is not one of"),
    (lambda wf: _first(wf, "MiniMaxHotfixCLIPLoader")["widgets_values"].pop(), "no widget value left for device"),
    (lambda wf: _first(wf, "MiniMaxHotfixVAELoader")["widgets_values"].append(1), "1 widget values left over"),
    (lambda wf: _first(wf, "RandomNoise")["widgets_values"].__setitem__(0, -1), "outside"),
    (lambda wf: _first(wf, "RandomNoise")["widgets_values"].__setitem__(1, "sometimes"), "control after generate"),
    (lambda wf: _first(wf, "CreateVideo")["widgets_values"].__setitem__(0, "24"), "expected a number"),
    (lambda wf: _first(wf, "SaveVideo")["widgets_values"].__setitem__(2, "mpeg2"), "format.codec: 'mpeg2'"),
    (lambda wf: _disconnect(wf, wf["links"][-1]), "not connected"),
    (lambda wf: wf["links"][-1].__setitem__(5, "IMAGE"), "VIDEO output, IMAGE link, VIDEO input"),
    (lambda wf: wf["links"].pop(), "inputs pointing at links that do not exist"),
])
def test_the_checks_catch_a_broken_workflow(break_it, error, snapshot_specs):
    workflow = load(PACK_ROOT / "workflows" / "MiniMax H3 text to video.json")
    check_workflow(copy.deepcopy(workflow), snapshot_specs)
    break_it(workflow)
    with pytest.raises(AssertionError, match=re.escape(error)):
        check_workflow(workflow, snapshot_specs)


def _disconnect(workflow: dict, link: list) -> None:
    workflow["links"].remove(link)
    nodes = {node["id"]: node for node in workflow["nodes"]}
    nodes[link[1]]["outputs"][link[2]]["links"].remove(link[0])
    nodes[link[3]]["inputs"][link[4]]["link"] = None


def _first(workflow: dict, node_type: str) -> dict:
    return next(node for node in workflow["nodes"] if node["type"] == node_type)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_models_load_through_the_pack_with_official_file_names(path):
    workflow = load(path)
    types = [node["type"] for node in workflow["nodes"]]
    assert not set(types) & set(swap_loaders.STOCK_TO_PACK), "a stock loader left in a bundled workflow"
    assert "MiniMaxHotfixUNETLoader" in types and "MiniMaxHotfixVAELoader" in types
    for node in workflow["nodes"]:
        if node["type"] == "CLIPLoaderGGUFDynamicVRAM":
            assert any(link[1] == node["id"] for link in workflow["links"] if link[5] == "CLIP")
            consumers = {link[3] for link in workflow["links"] if link[1] == node["id"]}
            assert {next(n["type"] for n in workflow["nodes"] if n["id"] == c) for c in consumers} == {
                "MiniMaxHotfixApplyCLIP"}, "the GGUF CLIP must reach the graph through MiniMaxHotfixApplyCLIP"
        if node["type"] not in PACK_LOADERS:
            continue
        properties = node["properties"]
        assert properties["cnr_id"] == swap_loaders.PACK_CNR_ID
        assert properties["Node name for S&R"] == node["type"]
        (model,) = properties["models"]
        assert model["name"] == node["widgets_values"][0]
        assert model["url"].startswith(MODEL_URL) and model["url"].endswith(f"/{model['directory']}/{model['name']}")


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_each_workflow_carries_a_note_on_its_fixes(path):
    notes = [node["widgets_values"][0] for node in load(path)["nodes"] if node["type"] == "MarkdownNote"]
    assert len(notes) == 1
    # the template browser titles a custom node's template with its file name, and nothing else
    assert notes[0].startswith(f"## {path.stem}, with MiniMax Hotfix\n")
    assert "**Fixes that apply here**" in notes[0] and "swap_loaders.py" in notes[0]
    assert "RuntimeError" in notes[0] or "noise" in notes[0]


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_each_workflow_has_its_thumbnail(path):
    """The template browser shows <name>.jpg beside <name>.json (the frontend asks for a JPEG for every custom-node
    template); tools/template_thumbnails.py draws them."""
    thumbnail = path.with_suffix(".jpg").read_bytes()
    assert thumbnail.startswith(b"\xff\xd8\xff") and thumbnail.endswith(b"\xff\xd9"), "not a JPEG"
    assert len(thumbnail) <= THUMBNAIL_MAX_BYTES


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_reverse_then_swap_gives_the_bundled_workflow_back(path):
    workflow = load(path)
    pack_ver = next(node["properties"]["ver"] for node in workflow["nodes"] if node["type"] in PACK_LOADERS)
    stock = copy.deepcopy(workflow)
    assert swap_loaders.swap(stock, reverse=True)
    assert not {node["type"] for node in stock["nodes"]} & PACK_LOADERS
    swap_loaders.swap(stock, version=pack_ver)
    assert json.dumps(stock) == json.dumps(workflow)


def test_subgraphs_are_lowered_as_the_frontend_queues_them(snapshot_specs):
    """The H3 image-to-video template: the nodes of its subgraph instance (105) become "105:id", links through the
    subgraph's input node reach the outer producers or the instance's widget values, links through its output node
    the inner producer; an unlinked image input is left out, notes are dropped."""
    workflow = official_template(OFFICIAL_TEMPLATES["H3 image-to-video"])
    (instance,) = [node for node in workflow["nodes"] if node["id"] == 105]
    prompt = ui_to_api(workflow, snapshot_specs)
    assert "105" not in prompt and {node["class_type"] for node in prompt.values()}.isdisjoint(FRONTEND_ONLY)
    conditioning = prompt["105:104"]
    assert conditioning["class_type"] == "MiniMaxH3ImageToVideo"
    assert conditioning["inputs"]["first_frame"] == ["114", 0] and conditioning["inputs"]["width"] == ["115", 0]
    assert "last_frame" not in conditioning["inputs"]
    named = instance["widgets_values_named"]  # the template package's own record of the instance's widgets
    assert conditioning["inputs"]["prompt"] == named["prompt"]  # the instance's, not the inner node's own value
    assert named["prompt"] != next(node for node in swap_loaders.ui_nodes(workflow) if node["id"] == 104)[
        "widgets_values"][0]
    assert prompt["105:15"]["inputs"]["noise_seed"] == named["noise_seed"]
    assert prompt["105:11"]["inputs"]["vae_name"] == named["vae_name"]
    assert prompt["92"]["inputs"]["video"] == ["105:91", 0]
    assert prompt["105:23"]["inputs"]["vae"] == ["105:24", 0]


def test_nested_subgraphs_are_lowered_with_their_instance_path(snapshot_specs):
    """Subgraph "outer" holds an instance (2) of subgraph "inner", which holds a PrimitiveInt (3) whose value is
    promoted twice: the node is "1:2:3" and takes the outermost instance's widget value."""
    def subgraph(name, node):
        link = {"id": 10, "origin_id": -10, "origin_slot": 0, "target_id": node["id"], "target_slot": 0, "type": "INT"}
        out = {"id": 11, "origin_id": node["id"], "origin_slot": 0, "target_id": -20, "target_slot": 0, "type": "INT"}
        return {"id": name, "nodes": [node], "links": [link, out],
                "inputs": [{"name": "value", "type": "INT", "linkIds": [10]}],
                "outputs": [{"name": "INT", "type": "INT", "linkIds": [11]}]}

    def holding(node_id, node_type, widgets_values):
        return {"id": node_id, "type": node_type, "widgets_values": widgets_values,
                "inputs": [{"name": "value", "type": "INT", "widget": {"name": "value"}, "link": 10}]}

    workflow = {"nodes": [{"id": 1, "type": "outer", "widgets_values": [7]}], "links": [],
                "definitions": {"subgraphs": [subgraph("outer", holding(2, "inner", [5])),
                                              subgraph("inner", holding(3, "PrimitiveInt", [1, "fixed"]))]}}
    assert ui_to_api(workflow, snapshot_specs) == {
        "1:2:3": {"class_type": "PrimitiveInt", "inputs": {"value": 7}, "_meta": {"title": "PrimitiveInt"}}}


# ---- with a live ComfyUI (COMFYUI_PATH) ----

@pytest.fixture(scope="module")
def comfy_base(tmp_path_factory):
    """The server's base directory: custom_nodes/, models/, output/ and its log, comfyui.log."""
    return tmp_path_factory.mktemp("comfy_base")


@pytest.fixture(scope="module")
def comfy_server(comfyui, comfy_base):
    """A ComfyUI server on a free port: this pack, the checkout's own custom nodes and stand-ins for ComfyUI-GGUF,
    empty model folders."""
    with comfyui_with_pack(Path(comfyui), comfy_base) as server:
        yield server


def _comparable(spec: dict) -> dict:
    """A node spec without the option lists that depend on the files of the ComfyUI at hand."""
    spec = copy.deepcopy(spec)
    for section in spec["input"].values():
        for name, entry in section.items():
            if name in FOLDER_LISTED_INPUTS:
                entry[0] = "COMBO" if isinstance(entry[0], list) else entry[0]
                if len(entry) > 1:
                    entry[1].pop("options", None)
    return spec


def _snapshot_entry(spec: dict) -> dict:
    return {key: spec[key] for key in ("input", "input_order", "output", "output_name", "python_module") if key in spec}


def test_snapshot_matches_live_comfyui(comfy_server):
    _, object_info = comfy_server
    snapshot = load(SPECS_FILE)
    documents = [load(path) for path in WORKFLOWS] + [official_template(stem) for stem in OFFICIAL_TEMPLATES.values()]
    subgraphs = {subgraph["id"] for doc in documents for subgraph in (doc.get("definitions") or {}).get("subgraphs", [])}
    used = sorted({node["type"] for doc in documents for node in swap_loaders.ui_nodes(doc)} - FRONTEND_ONLY - subgraphs)
    if os.environ.get("MINIMAX_HOTFIX_UPDATE_SPECS") == "1":
        snapshot["nodes"] = {name: _snapshot_entry(object_info[name]) if name in object_info
                             else snapshot["nodes"][name] for name in used}
        SPECS_FILE.write_text(json.dumps(snapshot, indent=1) + "\n", encoding="utf-8")
    assert sorted(snapshot["nodes"]) == used
    live = [name for name in used if name in object_info and name not in STAND_INS]
    stale = [name for name in live
             if _comparable(_snapshot_entry(object_info[name])) != _comparable(snapshot["nodes"][name])]
    assert not stale, f"{SPECS_FILE.name} differs from this ComfyUI for {stale}; MINIMAX_HOTFIX_UPDATE_SPECS=1 rewrites it"


def test_comfyui_lists_and_serves_the_workflows_and_their_thumbnails(comfy_server):
    """At the addresses the frontend builds: /api/workflow_templates/<pack folder>/<name>.json and <name>.jpg."""
    url, _ = comfy_server
    status, body = http(url + "/workflow_templates")
    assert status == 200
    assert sorted(json.loads(body)["minimax-hotfix"]) == sorted(path.stem for path in WORKFLOWS)
    for path in WORKFLOWS:
        status, served = http(f"{url}/api/workflow_templates/minimax-hotfix/{quote(path.name)}")
        assert status == 200 and served == path.read_bytes(), path.name
        thumbnail = path.with_suffix(".jpg")
        status, content_type, served = _get(f"{url}/api/workflow_templates/minimax-hotfix/{quote(thumbnail.name)}")
        assert (status, content_type) == (200, "image/jpeg") and served == thumbnail.read_bytes(), thumbnail.name


def _get(url: str) -> tuple[int, str, bytes]:
    """(status, Content-Type, body) of a GET; HTTP errors are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            return reply.status, reply.headers.get("Content-Type"), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type"), exc.read()


def assert_only_model_files_missing(url: str, object_info: dict, workflow: dict) -> None:
    absent = {node["type"] for node in workflow["nodes"]} - set(object_info) - FRONTEND_ONLY
    assert not absent, f"node types missing from ComfyUI: {sorted(absent)}"
    prompt = check_workflow(workflow, object_info)
    problems, missing_files = prompt_errors(url, prompt)
    assert not problems
    model_inputs = {(node_id, name) for node_id, node in prompt.items() for name in node["inputs"]
                    if name in MODEL_FILE_INPUTS}
    assert missing_files == model_inputs, "every model file input, and nothing else, is reported missing"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_prompt_validation_fails_only_for_missing_model_files(path, comfy_server):
    url, object_info = comfy_server
    assert_only_model_files_missing(url, object_info, load(path))


@pytest.mark.parametrize("build", [music3_gguf, music3_checkpoint], ids=["CLIPLoaderGGUFDynamicVRAM", "CheckpointLoaderSimple"])
def test_swapped_user_workflows_pass_prompt_validation(build, comfy_server):
    url, object_info = comfy_server
    workflow = build()
    assert_only_model_files_missing(url, object_info, workflow)  # as the user had it
    changes = swap_loaders.swap(workflow)
    assert changes.inserted
    assert_only_model_files_missing(url, object_info, workflow)


def test_prompt_check_reports_a_wrong_widget_value(comfy_server):
    url, object_info = comfy_server
    prompt = ui_to_api(load(PACK_ROOT / "workflows" / "MiniMax Music 3.json"), object_info)
    encoder = next(node for node in prompt.values() if node["class_type"] == "MiniMaxMusic3TextEncode")
    encoder["inputs"]["top_k"] = 0
    problems, missing_files = prompt_errors(url, prompt)
    assert [error["extra_info"]["input_name"] for _, _, error in problems] == ["top_k"]
    assert {name for _, name in missing_files} == {"unet_name", "clip_name", "vae_name"}


def prompt_errors(url: str, prompt: dict):
    """POSTs the prompt; returns (errors other than a missing model file, {(node id, input) of missing files})."""
    status, body = http(url + "/prompt", {"prompt": prompt, "client_id": "minimax-hotfix-tests"})
    reply = json.loads(body)
    problems, missing_files = [], set()
    for node_id, node_errors in reply.get("node_errors", {}).items():
        for error in node_errors["errors"]:
            input_name = error.get("extra_info", {}).get("input_name")
            if error["type"] == "value_not_in_list" and input_name in MODEL_FILE_INPUTS:
                missing_files.add((node_id, input_name))
            else:
                problems.append((node_id, node_errors["class_type"], error))
    if status != 200 and reply.get("error", {}).get("type") != "prompt_outputs_failed_validation":
        problems.append((None, None, reply.get("error")))
    return problems, missing_files


def test_the_swap_tools_api_loader_table_matches_comfyui(comfy_server):
    _, object_info = comfy_server
    core = {name: outputs for name, outputs in swap_loaders.API_LOADER_OUTPUTS.items()
            if "GGUF" not in name and name not in swap_loaders.RAYLIGHT_LOADERS}  # those: test_swap_loaders.py
    assert {name: object_info[name]["output"] for name in core} == core
    for stand_in in STAND_INS:
        assert object_info[stand_in]["output"] == swap_loaders.API_LOADER_OUTPUTS[stand_in]


# ---- the swap route, fuzzed (one server, every request in a row) ----

ROUTE_EXAMPLES = examples(700)
ROUTE_FIELDS = ("workflow", "reverse", "only")


def route_bodies():
    """Request bodies: a workflow (mutated, generated, any JSON) with right and wrong "reverse" and "only", unknown
    fields, any JSON value, bytes that are no JSON or no UTF-8."""
    only = st.none() | st.fixed_dictionaries({"graph": st.none() | st.sampled_from(["sub-1", "x"]),
                                               "node": st.integers(0, 12) | st.text(max_size=2)}) | json_values
    requests = st.fixed_dictionaries({"workflow": workflows()}, optional={
        "reverse": st.booleans() | json_values, "only": only, "revers": st.booleans()})
    return st.one_of(requests.map(lambda body: json.dumps(body).encode()), json_values.map(lambda v: json.dumps(v).encode()),
                     st.binary(max_size=40), st.just(b'{"workflow": {"nodes": [], "x": NaN}}'))


def library_answer(data: bytes):
    """What the route must answer, from the swap tool as a library: ("ok", swapped workflow) or ("error", message);
    None where the request itself is malformed (the route's own 400)."""
    try:
        body = swap_loaders.parse_json(data.decode("utf-8"), allow_nan=False)
    except (UnicodeDecodeError, swap_loaders.WorkflowError):
        return None
    if (not isinstance(body, dict) or set(body) - set(ROUTE_FIELDS) or not isinstance(body.get("reverse", False), bool)
            or "workflow" not in body):
        return None
    try:
        if swap_loaders.workflow_format(body["workflow"]) != "ui":
            return None
        swap_loaders.swap(body["workflow"], reverse=body.get("reverse", False), only=body.get("only"))
    except swap_loaders.WorkflowError as exc:
        return "error", str(exc)
    return "ok", body["workflow"]


def check_route(url: str, data: bytes) -> None:
    status, reply = http(url + ROUTE, data)
    answer = json.loads(reply)
    expected = library_answer(data)
    assert status in (200, 400), (status, reply[:300])
    if status == 400:
        assert list(answer) == ["error"] and isinstance(answer["error"], str) and answer["error"]
        assert expected is None or expected == ("error", answer["error"])
    else:
        assert expected == ("ok", answer["workflow"])
        assert sorted(answer) == ["changed", "kept", "summary", "warnings", "workflow"]


ROUTE = "/minimax_hotfix/swap"
ROUTE_CASES = [  # the requests (500 before) and what the fuzzing found, kept explicit
    (b"[1, 2]", "the request body is a list, expected an object with \"workflow\" (and \"reverse\", \"only\")"),
    (b'"x"', "the request body is a string, expected an object with \"workflow\" (and \"reverse\", \"only\")"),
    (b"null", "the request body is null, expected an object with \"workflow\" (and \"reverse\", \"only\")"),
    (b"{nope", "the request body: malformed JSON at line 1 column 2: Expecting property name enclosed in double quotes"),
    (b'{"workflow": {"nodes": []}, "only": "x"}',
     '"only" is a string, expected {"graph": subgraph id or null, "node": node id}'),
    (b'{"workflow": {"nodes": []}, "reverse": "yes"}', '"reverse" is a string, expected true or false'),
    (b'{"workflow": {"nodes": [], "definitions": {"subgraphs": [1, "x", {"nodes": 5}]}}}',
     "malformed UI workflow: definitions.subgraphs[0]: the subgraph is a number, expected an object"),
    (b'{"workflow": {"nodes": [{"id": [1], "type": "VAELoader"}]}}',
     'malformed UI workflow: nodes[0]: "id" is a list, expected a number or a string'),
    (b"{}", '"workflow" is missing, expected a UI-format workflow'),
    (b'{"workflow": {"1": {"class_type": "VAELoader"}}}',
     '"workflow" is an API-format workflow, expected a UI-format workflow (what ComfyUI\'s frontend saves)'),
    (b'{"workflow": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     "the request body: nested more than 200 levels deep; no ComfyUI workflow is"),
    (b'{"workflow": {"nodes": [], "x": NaN}}', "the request body: NaN is not a JSON number"),
    (b'{"workflow": {"nodes": []}, "revers": true}', 'unknown field "revers"; the fields are workflow, reverse, only'),
    (b"\xff", "the request body is not UTF-8 text (byte 0)"),
]


def test_the_swap_route_answers_400_to_every_request_it_cannot_serve(comfy_server, comfy_base):
    url, _ = comfy_server
    for data, message in ROUTE_CASES:
        assert http(url + ROUTE, data) == (400, json.dumps({"error": message}).encode()), data[:60]
    oversized = json.dumps({"workflow": {"nodes": [], "pad": "x" * (33 << 20)}}).encode()  # over MAX_BODY_BYTES
    assert http(url + ROUTE, oversized) == (400, b'{"error": "the request body is larger than 32 MiB"}')
    assert "Traceback" not in (comfy_base / "comfyui.log").read_text(encoding="utf-8", errors="replace")


def test_the_swap_route_fuzzed_answers_as_the_library_and_never_500(comfy_server, comfy_base):
    url, _ = comfy_server

    @settings(max_examples=ROUTE_EXAMPLES)
    @given(data=route_bodies())
    def check(data):
        check_route(url, data)

    check()
    assert "Traceback" not in (comfy_base / "comfyui.log").read_text(encoding="utf-8", errors="replace")
