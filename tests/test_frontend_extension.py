"""The pack's frontend extension (web/) in headless Chromium against the real frontend that ComfyUI serves (`main.py
--cpu`, the pack installed): for every official MiniMax template (the comfyui-workflow-templates-json index) and the
bundled workflows, the "Fix this workflow" command gives exactly the swap tool's result, one undo restores the
original, the reverse command gives the original back, and the swapped workflow passes /prompt validation apart from
model files; the node menu entries do the same for one node of each kind. Screenshots of the menu entry and of a
swapped workflow go to the test's temporary folder (MINIMAX_HOTFIX_UPDATE_SCREENSHOTS=1: to docs/).

Needs COMFYUI_PATH and Debian's `chromium` package (`apt-get install -y chromium`); skips without the browser.
About 2 minutes on 2 cores, one ComfyUI start and one browser for the whole module."""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from hotfix_testing.cdp import Page, chromium_binary
from hotfix_testing.comfyui_server import FRONTENDS, PACK_ROOT, comfyui_with_pack, front_end_options, http
from hotfix_testing.user_workflows import music3_checkpoint, music3_gguf
from hotfix_testing.workflow_api import MODEL_FILE_INPUTS, TEMPLATES, official_template
from minimax_hotfix import swap_loaders

pytestmark = [pytest.mark.browser, pytest.mark.e2e]  # Chromium and a real ComfyUI server (tests/hotfix_testing/tiers.py)

APP = "window.comfyAPI.app.app"
FIX = f"{APP}.extensionManager.command.execute('MiniMaxHotfix.FixWorkflow')"
UNDO_STEPS = f"{APP}.extensionManager.workflow.activeWorkflow.changeTracker.undoQueue.length"
REVERSE = f"{APP}.extensionManager.command.execute('MiniMaxHotfix.ReverseWorkflow')"
# The page's export once it has settled: some nodes (ComfySwitchNode's matched types) resolve their slot types a
# moment after a load, so the graph is read until two reads 250 ms apart agree.
SETTLED_EXPORT = (f"(async () => {{ let last = null; for (let i = 0; i < 40; i++) {{ "
                  f"const now = JSON.stringify({APP}.rootGraph.serialize()); if (now === last) return JSON.parse(now); "
                  "last = now; await new Promise(done => setTimeout(done, 250)); } "
                  "throw new Error('the graph did not settle in 10 s'); })()")


def _bundled_stock(stem: str) -> dict:
    workflow = json.loads((PACK_ROOT / "workflows" / f"{stem}.json").read_text(encoding="utf-8"))
    swap_loaders.swap(workflow, reverse=True)
    return workflow


def _official_minimax_templates() -> list[tuple[str, dict]]:
    """The templates that ComfyUI's template index lists with MiniMax in their entry (21 in 0.33.0's package)."""
    index = json.loads((TEMPLATES / "index.json").read_text(encoding="utf-8"))
    names = sorted({entry["name"] for category in index for entry in category.get("templates", [])
                    if "minimax" in json.dumps(entry).lower()})
    return [(f"template {name}", official_template(name)) for name in names]


BUNDLED = sorted(path.stem for path in (PACK_ROOT / "workflows").glob("*.json"))
# What the newest frontend runs of WORKFLOWS (the pinned one runs them all): a template with subgraphs, the Music 3
# template, a bundled workflow and a GGUF graph (an Apply node inserted); on 1.58.1 each of them was red before the
# extension recorded its own undo step
ON_EVERY_FRONTEND = {"template video_minimax_h3_t2v", "template audio_minimax_music_3",
                     "bundled MiniMax H3 text to video (stock)", "Music 3 CLIPLoaderGGUFDynamicVRAM"}
WORKFLOWS = (_official_minimax_templates() + [(f"bundled {stem} (stock)", _bundled_stock(stem)) for stem in BUNDLED]
             + [("Music 3 CLIPLoaderGGUFDynamicVRAM", music3_gguf()), ("Music 3 CheckpointLoaderSimple", music3_checkpoint())])


@pytest.fixture(scope="module", params=FRONTENDS)
def page(comfyui, tmp_path_factory, request):
    """The pack's extension in a real frontend: the one ComfyUI's requirements pin, and the newest release."""
    if not chromium_binary():
        pytest.skip("needs a Chromium browser on PATH (Debian: apt-get install -y chromium)")
    with comfyui_with_pack(Path(comfyui), tmp_path_factory.mktemp("comfy_base"),
                           options=front_end_options(request.param)) as (url, _):
        browser = Page()
        try:
            browser.navigate(url)
            # The extension registered, and the canvas mounted: the workflow service has opened its first workflow.
            browser.wait_for(f"!!({APP}?.extensions?.some(e => e.name === 'MiniMaxHotfix.Swap') "
                             f"&& {APP}.extensionManager?.workflow?.activeWorkflow?.changeTracker)")
            yield browser, url, request.param
        finally:
            browser.close()


def _export(page) -> dict:
    return page.evaluate(SETTLED_EXPORT)


def _load(page, workflow) -> dict:
    """Loads a workflow into the page as a fresh graph; returns it as the page exports it. Chromium now and then
    drops the load's promise ("Promise was collected", seen once in 1 of ~100 loads): that load is done again."""
    load = f"{APP}.loadGraphData({json.dumps(workflow)}, true, true, null)"
    try:
        page.evaluate(load)
    except RuntimeError as exc:
        if "Promise was collected" not in str(exc):
            raise
        page.evaluate(load)
    return _export(page)


def _undo(page) -> dict:
    page.evaluate(f"{APP}.extensionManager.workflow.activeWorkflow.changeTracker.undo()")
    return _export(page)


def _comparable(workflow: dict) -> dict:
    workflow = copy.deepcopy(workflow)
    workflow.get("extra", {}).pop("ds", None)  # the view (zoom, scroll), not the graph
    # Frontend 1.58 reloads a state (its undo) with the links in id order (a link list is a set keyed by id) and lays
    # some nodes out anew (MiniMaxH3ReferenceToVideo: 364 -> 384 high): the swap changes neither
    for graph in [workflow, *(workflow.get("definitions") or {}).get("subgraphs", [])]:
        if isinstance(graph.get("links"), list):
            graph["links"].sort(key=lambda link: link[0] if isinstance(link, list) else link.get("id"))
        for node in graph.get("nodes") or []:
            node.pop("size", None)
    return workflow


def _structure(workflow: dict) -> list:
    """Every node (subgraphs included) with its type and the links into it."""
    return [(node["id"], node["type"], [slot.get("link") for slot in node.get("inputs", [])])
            for node in swap_loaders.ui_nodes(workflow)]


def _prompt_problems(page, url) -> list:
    """/prompt errors of the page's workflow other than a missing model file."""
    prompt = page.evaluate(f"(async () => (await {APP}.graphToPrompt()).output)()")
    status, body = http(url + "/prompt", {"prompt": prompt, "client_id": "minimax-hotfix-frontend-test"})
    reply = json.loads(body)
    problems = []
    for errors in reply.get("node_errors", {}).values():
        for error in errors["errors"]:
            input_name = error.get("extra_info", {}).get("input_name")
            if not (error["type"] == "value_not_in_list" and input_name in MODEL_FILE_INPUTS):
                problems.append((errors["class_type"], error["type"], input_name))
    if status != 200 and reply.get("error", {}).get("type") != "prompt_outputs_failed_validation":
        problems.append(("prompt", reply.get("error", {}).get("type"), reply.get("error", {}).get("message")))
    return sorted(problems, key=str)


def _check(page, url, workflow, run_js, only=None) -> swap_loaders.Changes:
    """Runs ``run_js`` on ``workflow`` in the page; its result must equal the swap tool's, undo must restore the
    original, and /prompt must find nothing new besides model files. Returns the tool's changes."""
    original = _load(page, workflow)
    problems_before = _prompt_problems(page, url)
    steps_before = page.evaluate(UNDO_STEPS)
    page.evaluate(run_js)
    swapped = _export(page)
    expected = copy.deepcopy(original)
    changes = swap_loaders.swap(expected, only=only)
    if not changes:  # (the frontend itself may still be resizing nodes of some templates: sizes are not compared)
        assert page.evaluate(UNDO_STEPS) == steps_before, "nothing to change, and the page loaded nothing"
        assert _structure(swapped) == _structure(original)
        return changes
    assert _comparable(_undo(page)) == _comparable(original), "one undo restores the original"
    tool = _load(page, expected)
    assert _comparable(swapped) == _comparable(tool), "the page's result equals the swap tool's"
    problems_after = _prompt_problems(page, url)
    assert set(problems_after) <= set(problems_before), f"/prompt problems the swap added: {problems_after}"
    return changes


@pytest.mark.parametrize("name,workflow", WORKFLOWS, ids=[name for name, _ in WORKFLOWS])
def test_fix_command_equals_the_swap_tool_and_reverse_gives_the_original(page, name, workflow):
    browser, url, frontend = page
    if frontend != "pinned" and name not in ON_EVERY_FRONTEND:
        pytest.skip(f"{frontend} runs a sample of the workflows (ON_EVERY_FRONTEND): CI time")
    changes = _check(browser, url, workflow, FIX)
    if changes:
        original = _load(browser, workflow)
        browser.evaluate(FIX)
        browser.evaluate(REVERSE)
        assert _comparable(_export(browser)) == _comparable(original), "the reverse command gives the original back"


def test_the_official_minimax_templates_are_all_there():
    names = [name for name, _ in _official_minimax_templates()]
    assert len(names) == 21, names


NODE_CASES = [(lambda: _bundled_stock("MiniMax Music 3"), node_type) for node_type in ("VAELoader", "CLIPLoader",
                                                                                       "UNETLoader")]
NODE_CASES += [(music3_gguf, "CLIPLoaderGGUFDynamicVRAM"), (music3_checkpoint, "CheckpointLoaderSimple")]


def _menu_item(node_id) -> str:
    """JavaScript: the node's MiniMax Hotfix menu entries as the frontend collects them; the single one is chosen."""
    return (f"{APP}.collectNodeMenuItems({APP}.rootGraph.getNodeById({node_id}))"
            ".filter(item => item?.content?.includes('MiniMax Hotfix'))")


@pytest.mark.parametrize("build,node_type", NODE_CASES, ids=[node_type for _, node_type in NODE_CASES])
def test_node_menu_entry_equals_the_swap_tool_for_that_node(page, build, node_type):
    browser, url, _ = page
    workflow = build()
    node_id = next(node["id"] for node in workflow["nodes"] if node["type"] == node_type)
    run = (f"(async () => {{ const items = {_menu_item(node_id)}; "
           "if (items.length !== 1) throw new Error('menu entries: ' + JSON.stringify(items.map(i => i.content))); "
           "await items[0].callback(); })()")
    _check(browser, url, workflow, run, only={"graph": None, "node": node_id})


def _close_overlays(browser) -> None:
    """Closes the dialog ComfyUI opens on a first visit (templates), context menus and toasts, so screenshots show
    the graph."""
    browser.evaluate("document.querySelectorAll('.litecontextmenu').forEach(menu => menu.close?.() ?? menu.remove())")
    for kind in ("keyDown", "keyUp"):
        browser.send("Input.dispatchKeyEvent", type=kind, key="Escape", code="Escape", windowsVirtualKeyCode=27)
    browser.evaluate("document.querySelectorAll('.p-toast-close-button, .p-toast-icon-close').forEach(b => b.click())")
    time.sleep(0.5)


def test_screenshots_of_the_menu_entry_and_of_a_swapped_workflow(page, tmp_path):
    browser, _, _ = page
    workflow = _bundled_stock("MiniMax Music 3")
    node_id = next(node["id"] for node in workflow["nodes"] if node["type"] == "VAELoader")
    _load(browser, workflow)
    _close_overlays(browser)
    x, y = browser.evaluate(f"(() => {{ const node = {APP}.rootGraph.getNodeById({node_id}); "
                            f"return {APP}.canvasPosToClientPos([node.pos[0] + 40, node.pos[1] + 10]); }})()")
    browser.click(x, y, button="right")
    time.sleep(1)
    menu = browser.evaluate("[...document.querySelectorAll('.litecontextmenu')].map(m => m.innerText).join('\\n')")
    assert "Replace with MiniMaxHotfixVAELoader (MiniMax Hotfix)" in menu.splitlines(), menu
    shots = {"screenshot-menu-entry.png": tmp_path / "menu.png"}
    browser.screenshot(shots["screenshot-menu-entry.png"])
    _close_overlays(browser)
    browser.evaluate(FIX)
    time.sleep(1)  # the summary toast
    shots["screenshot-swapped-workflow.png"] = tmp_path / "swapped.png"
    browser.screenshot(shots["screenshot-swapped-workflow.png"])
    assert all(path.stat().st_size > 10_000 for path in shots.values())
    if os.environ.get("MINIMAX_HOTFIX_UPDATE_SCREENSHOTS") == "1":
        for name, path in shots.items():
            shutil.copyfile(path, PACK_ROOT / "docs" / name)


TRACKER_FIELDS = ("undoQueue", "activeState", "_restoringState")
NOT_ONE_STEP = "may not be one undo step"
# The toasts the extension sends from now on, kept on the page (the toast service renders them its own way per frontend)
RECORD_TOASTS = (f"(() => {{ const toast = {APP}.extensionManager.toast; window.minimaxHotfixToasts = []; "
                 "if (!toast.recordedAdd) { toast.recordedAdd = toast.add; "
                 "toast.add = (message) => { window.minimaxHotfixToasts.push(message); "
                 "return toast.recordedAdd(message); }; } })()")
SAID = f"window.minimaxHotfixToasts.some(m => String(m.detail).includes({json.dumps(NOT_ONE_STEP)}))"


def _tracker_without_fields(page, hidden: bool) -> None:
    """Gives the open workflow a change tracker that, as far as an extension can tell, lacks the private fields the
    swap reads (as a frontend that renamed them would), or gives back the real one. The frontend's own code still
    reaches them by name: a frontend that renamed them would use its new names, and 1.58's own load reads them."""
    workflow = f"{APP}.extensionManager.workflow.activeWorkflow"
    if hidden:
        page.evaluate(f"(() => {{ const w = {workflow}; window.minimaxHotfixRealTracker = w.changeTracker; "
                      f"const hidden = {json.dumps(TRACKER_FIELDS)}; "
                      "w.changeTracker = new Proxy(w.changeTracker, "
                      "{ has: (tracker, key) => !hidden.includes(key) && Reflect.has(tracker, key) }); })()")
    else:
        page.evaluate(f"(() => {{ {workflow}.changeTracker = window.minimaxHotfixRealTracker; }})()")


@pytest.mark.parametrize("renamed", [False, True], ids=["the frontend's own tracker", "tracker fields renamed"])
def test_the_swap_says_plainly_when_it_cannot_be_one_undo_step(page, renamed):
    browser, _, frontend = page
    _load(browser, _bundled_stock("MiniMax Music 3"))
    browser.evaluate(RECORD_TOASTS)
    if renamed:
        _tracker_without_fields(browser, True)
    try:
        browser.evaluate(FIX)
        swapped = _export(browser)
    finally:
        if renamed:
            _tracker_without_fields(browser, False)
    assert any(node["type"].startswith("MiniMaxHotfix") for node in swapped["nodes"]), "the swap ran"
    toasts = browser.evaluate("window.minimaxHotfixToasts.map(m => String(m.detail))")
    assert any("MiniMax Hotfix" in m.get("summary", "") for m in browser.evaluate("window.minimaxHotfixToasts")), \
        (frontend, "the swap's toast was recorded", toasts)
    assert browser.evaluate(SAID) is renamed, (frontend, toasts)
