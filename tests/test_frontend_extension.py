"""The pack's frontend extension (web/) in headless Chromium against ComfyUI's real frontend: the workflow command
and the node menu entries give exactly the swap tool's result, one undo restores the original, and the swapped
workflow passes /prompt validation apart from model files. Needs COMFYUI_PATH and Debian's `chromium` package."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from cdp import Page, chromium_binary
from comfyui_server import PACK_ROOT, comfyui_with_pack, http
import swap_loaders
from user_workflows import music3_checkpoint, music3_gguf

DOCS = PACK_ROOT / "docs"
MODEL_FILE_INPUTS = {"unet_name", "clip_name", "vae_name", "ckpt_name"}
APP = "window.comfyAPI.app.app"


def _stock_bundled():
    cases = []
    for path in sorted((PACK_ROOT / "workflows").glob("*.json")):
        workflow = json.loads(path.read_text(encoding="utf-8"))
        swap_loaders.swap(workflow, reverse=True)
        cases.append((f"bundled {path.stem} (stock)", workflow))
    return cases


def _templates():
    from importlib import resources
    folder = resources.files("comfyui_workflow_templates_json") / "templates"
    cases = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json") and "minimax" in entry.name.lower():
            workflow = json.loads(entry.read_text(encoding="utf-8"))
            if isinstance(workflow, dict) and swap_loaders.swap(copy.deepcopy(workflow)):
                cases.append((f"template {entry.name}", workflow))
    return cases


@pytest.fixture(scope="module")
def page(comfyui, tmp_path_factory):
    if not chromium_binary():
        pytest.fail("needs Debian's chromium package: apt-get install -y chromium")
    with comfyui_with_pack(Path(comfyui), tmp_path_factory.mktemp("comfy_base")) as (url, object_info):
        browser = Page()
        try:
            browser.navigate(url)
            # The extension registered, and the canvas mounted: the workflow service has opened its first workflow.
            browser.wait_for(f"!!({APP}?.extensions?.some(e => e.name === 'MiniMaxHotfix.Swap') "
                             f"&& {APP}.extensionManager?.workflow?.activeWorkflow?.changeTracker)")
            yield browser, url
        finally:
            browser.close()


# The page's export once it has settled: some nodes (ComfySwitchNode's matched types) resolve their slot types a
# moment after a load, so the graph is read until two reads 250 ms apart agree.
SETTLED_EXPORT = (f"(async () => {{ let last = null; for (let i = 0; i < 40; i++) {{ "
                  f"const now = JSON.stringify({APP}.rootGraph.serialize()); if (now === last) return JSON.parse(now); "
                  "last = now; await new Promise(done => setTimeout(done, 250)); } "
                  "throw new Error('the graph did not settle in 10 s'); })()")


def _load(page, workflow) -> dict:
    """Loads a workflow into the page as a fresh graph; returns it as the page exports it."""
    page.evaluate(f"{APP}.loadGraphData({json.dumps(workflow)}, true, true, null)")
    return _export(page)


def _export(page) -> dict:
    return page.evaluate(SETTLED_EXPORT)


def _undo(page) -> dict:
    page.evaluate(f"{APP}.extensionManager.workflow.activeWorkflow.changeTracker.undo()")
    return _export(page)


def _comparable(workflow: dict) -> dict:
    workflow = copy.deepcopy(workflow)
    workflow.get("extra", {}).pop("ds", None)  # the view (zoom, scroll), not the graph
    return workflow


def _prompt_problems(page, url):
    """/prompt errors of the page's workflow other than a missing model file."""
    prompt = page.evaluate(f"(async () => (await {APP}.graphToPrompt()).output)()")
    status, body = http(url + "/prompt", {"prompt": prompt, "client_id": "minimax-hotfix-frontend-test"})
    reply = json.loads(body)
    problems = []
    for node_id, errors in reply.get("node_errors", {}).items():
        for error in errors["errors"]:
            if not (error["type"] == "value_not_in_list" and error.get("extra_info", {}).get("input_name") in MODEL_FILE_INPUTS):
                problems.append((errors["class_type"], error["type"], error.get("extra_info", {}).get("input_name")))
    if status != 200 and reply.get("error", {}).get("type") != "prompt_outputs_failed_validation":
        problems.append(("prompt", reply.get("error", {}).get("type"), reply.get("error", {}).get("message")))
    return sorted(problems, key=str), prompt


def _check(page, url, workflow, run_js, only=None):
    original = _load(page, workflow)
    problems_before, _ = _prompt_problems(page, url)
    reply = page.evaluate(run_js)
    swapped = _export(page)
    undone = _undo(page)
    assert _comparable(undone) == _comparable(original), "undo restores the original"
    expected = copy.deepcopy(original)
    assert swap_loaders.swap(expected, only=only)
    tool = _load(page, expected)
    assert _comparable(swapped) == _comparable(tool), "the page's result equals the swap tool's"
    problems_after, prompt = _prompt_problems(page, url)
    assert set(problems_after) <= set(problems_before), problems_after
    return reply, problems_after, prompt


CASES = _templates() + _stock_bundled() + [("Music 3 CLIPLoaderGGUF", music3_gguf()),
                                           ("Music 3 CheckpointLoaderSimple", music3_checkpoint())]


@pytest.mark.parametrize("name,workflow", CASES, ids=[name for name, _ in CASES])
def test_fix_workflow_command_equals_the_swap_tool(page, name, workflow):
    browser, url = page
    reply, problems, prompt = _check(browser, url, workflow, f"{APP}.extensionManager.command.execute("
                                     "'MiniMaxHotfix.FixWorkflow')")
    print(name, "problems left besides model files:", problems)


@pytest.mark.parametrize("build,node_type", [
    (lambda: _stock_bundled()[3][1], "VAELoader"), (lambda: _stock_bundled()[3][1], "CLIPLoader"),
    (lambda: _stock_bundled()[3][1], "UNETLoader"), (music3_gguf, "CLIPLoaderGGUF"),
    (music3_checkpoint, "CheckpointLoaderSimple")], ids=["VAELoader", "CLIPLoader", "UNETLoader", "CLIPLoaderGGUF",
                                                          "CheckpointLoaderSimple"])
def test_node_menu_entry_equals_the_swap_tool_for_that_node(page, build, node_type):
    browser, url = page
    workflow = build()
    node_id = next(node["id"] for node in workflow["nodes"] if node["type"] == node_type)
    run = (f"(async () => {{ const node = {APP}.rootGraph.getNodeById({node_id}); "
           f"const items = {APP}.collectNodeMenuItems(node).filter(i => i?.content?.includes('MiniMax Hotfix')); "
           "if (items.length !== 1) throw new Error('menu items: ' + JSON.stringify(items.map(i => i.content))); "
           "await items[0].callback(); return items[0].content; })()")
    _check(browser, url, workflow, run, only={"graph": None, "node": node_id})
    if node_type in ("VAELoader", "CLIPLoaderGGUF"):
        _load(browser, workflow)
        browser.evaluate(f"{APP}.extensionManager.command.execute('MiniMaxHotfix.FixWorkflow')")
        browser.screenshot(DOCS / f"screenshot-swapped-{node_type}.png")
