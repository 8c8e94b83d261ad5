"""Server-side fixing as users meet it (registry/prompt_fixing.py, nodes/prompt_fixing.py), through ComfyUI itself:

* ComfyUI's own ``validate_prompt`` on every bundled workflow and every official MiniMax template in API form (the
  frontend's conversion, tests/hotfix_testing/workflow_api.py), before and after the handler: no prompt that validated before fails
  after (red control: a handler whose swap names a node type ComfyUI does not have is caught);
* an API client on the simulated device (0.33.0 and the simulated "0.36/0.37 VAE" core): the stock H3 prompt with the
  int8 ConvRot models on a device without ``torch._int_mm``, and with a partly loaded video VAE, fails with the
  switch off (the red control) and the server's log names the bug, the fix and the switch; with the queuing user's
  setting on it completes and equals the all-CPU run;
* two users of a ``--multi-user`` server queuing at once, one with the setting on: each prompt is fixed or not by its
  own user's setting.
The browser's *Fix every run on this server*: tests/test_known_error_notice.py."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from hotfix_testing import simulated_cores
from hotfix_testing.comfyui_server import (
    SimulatedDevice,
    comfyui_with_pack,
    install_custom_nodes,
    simulated_accelerator_module,
)
from hotfix_testing.prompt_validation import RED_CONTROL
from hotfix_testing.seed_scenarios import (
    H3_COMPARED,
    H3_RESIDENT_MB,
    MIXED,
    RESERVE_MB,
    budgets,
    max_abs_diff,
    named,
    run,
    without_ck_rope,
    workflows,
)
from hotfix_testing.workflow_api import MODEL_FOLDERS, load, ui_to_api
from hotfix_testing.workflow_fuzzing import BUNDLED, minimax_templates
from minimax_hotfix.registry.prompt_fixing import FIX_EVERY_PROMPT_ENV, FIX_EVERY_RUN_SETTING

HERE = Path(__file__).resolve().parent
SPECS = load(HERE / "workflow_node_specs.json")["nodes"]
MPS_INT_MM_ERROR = simulated_accelerator_module().MPS_INT_MM_ERROR
needs_cores = pytest.mark.skipif(not simulated_cores.available(), reason="needs ../shared/comfyui (simulated cores)")


def node_types(workflow: dict) -> set[str]:
    graphs = [workflow, *(workflow.get("definitions") or {}).get("subgraphs", [])]
    subgraphs = {graph.get("id") for graph in graphs}
    return {node["type"] for graph in graphs for node in graph["nodes"]} - subgraphs


def api_prompts() -> dict[str, dict]:
    """Every bundled workflow (with the pack's loaders and with stock ones) and every official MiniMax template that
    this ComfyUI can run, as the frontend queues them. The templates of MiniMax's cloud API nodes (Hailuo, ...) load
    no model and have nodes this ComfyUI lacks: they are left out, and counted."""
    prompts = {}
    for path in BUNDLED:
        pack, stock = workflows(path)
        prompts[f"{path.stem} (pack)"] = ui_to_api(pack, SPECS)
        prompts[f"{path.stem} (stock)"] = ui_to_api(stock, SPECS)
    cloud = 0
    for name, text in minimax_templates():
        template = json.loads(text)
        if node_types(template) - set(SPECS) - {"MarkdownNote", "Note"}:
            cloud += 1
            continue
        prompts[f"template {name}"] = ui_to_api(template, SPECS)
    print(f"\n{cloud} MiniMax cloud API-node templates left out (no local model, nodes this ComfyUI lacks)")
    return prompts


def models_for(prompts: dict, folder: Path) -> Path:
    """Empty files under every name the prompts load (validation checks names, not contents)."""
    for prompt in prompts.values():
        for node in prompt.values():
            for name, value in node["inputs"].items():
                kind = MODEL_FOLDERS.get(name) or ("input" if name in ("image", "audio", "video") else None)
                if kind and isinstance(value, str):
                    (folder / kind).mkdir(parents=True, exist_ok=True)
                    (folder / kind / value).touch()
    (folder / "input").mkdir(exist_ok=True)
    return folder


def validated(comfyui: str, prompts: dict, models: Path, *arguments: str) -> dict:
    """tests/hotfix_testing/prompt_validation.py's outcome for ``prompts``, with the GGUF stand-in loaded beside the pack."""
    custom_nodes = models.parent / "custom_nodes"
    if not custom_nodes.exists():
        install_custom_nodes(Path(comfyui), custom_nodes, pack=False)
    done = subprocess.run([sys.executable, str(HERE / "hotfix_testing" / "prompt_validation.py"), comfyui, str(models),
                           str(custom_nodes), *arguments],
                          input=json.dumps(prompts), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_every_bundled_workflow_and_template_validates_as_before(comfyui, tmp_path):
    prompts = api_prompts()
    models = models_for(prompts, tmp_path / "models")
    stock = [name for name in prompts if not name.endswith("(pack)")]
    outcome = validated(comfyui, prompts, models, "--red-control", stock[0])
    broken = {name: outcome.pop(name) for name in list(outcome) if name.startswith(RED_CONTROL)}
    print("\nprompt | nodes | changed | valid before -> after | errors before -> after")
    for name, row in outcome.items():
        print(f"{name} | {row['nodes']} | {row['changed']} | {row['valid_before']} -> {row['valid_after']} | "
              f"{row['errors_before']} -> {row['errors_after']}")
    worse = [name for name, row in outcome.items() if row["valid_before"] and not row["valid_after"]]
    assert worse == []
    assert all(row["extra_data_kept"] for row in outcome.values())
    assert all(row["valid_before"] for row in outcome.values()), "a prompt that never validated shows nothing"
    assert all(outcome[name]["changed"] for name in stock), "a stock prompt the handler left alone"
    assert not any(outcome[name]["changed"] for name in outcome if name.endswith("(pack)")), "not idempotent"
    # red control: a handler that turns a stock loader into a node type this ComfyUI lacks fails the check
    assert [name for name, row in broken.items() if row["valid_before"] and not row["valid_after"]] == [
        RED_CONTROL + stock[0]]


# ---- real servers on the simulated device ----

def set_fix_every_run(url: str, value: bool, user: str | None = None) -> None:
    status, answer = request(url + f"/settings/{FIX_EVERY_RUN_SETTING}", value, user)
    assert status == 200, answer


def request(url: str, body=None, user: str | None = None, parse=True):
    """(status, parsed JSON body, or the bytes without ``parse``) of a POST (a GET without ``body``) as ``user`` (the
    ``comfy-user`` header)."""
    headers = {"Content-Type": "application/json", **({"comfy-user": user} if user else {})}
    data = None if body is None else json.dumps(body).encode()
    sent = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(sent, timeout=60) as response:
            status, answer = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, exc.read()
    return status, json.loads(answer or b"null") if parse else answer


@pytest.fixture(scope="module")
def multi_user_server(comfyui, tmp_path_factory):
    """(url, its folder, add_user) of one ``--multi-user`` server on the CPU with the pack and no models: ComfyUI's
    validation answers, naming each node's type. ``add_user(name)`` creates a user there and returns its id."""
    base = tmp_path_factory.mktemp("multi-user-server")
    with comfyui_with_pack(Path(comfyui), base, options=("--multi-user", "--cache-none")) as (url, _):
        def add_user(name: str) -> str:
            status, user = request(url + "/users", {"username": name})
            assert status == 200, user
            return user

        yield url, base, add_user


def stock_api_client_workflow(path=None) -> dict:
    """The stock workflow (default: H3 text to video) as an API client's script holds it: stock loaders, no node of
    the pack's."""
    _, stock = workflows(*([path] if path else []))
    stock["nodes"] = [node for node in stock["nodes"] if not node["type"].startswith("MiniMaxHotfix")]
    return stock


def off_then_on(server, tag: str, total_mb: float, scenario=None) -> dict:
    """The stock prompt of ``scenario`` (default: H3 text to video) queued with the default user's setting off, then
    on: {"off"|"on": (result, log text)}."""
    url, _, base = server
    log = base / "comfyui.log"
    prompt = {} if scenario is None else {"make_prompt": scenario.make_prompt, "probes": scenario.probes}
    outcome = {}
    for setting in (False, True):
        set_fix_every_run(url, setting)
        start = len(log.read_text())
        try:
            result = run(server, stock_api_client_workflow(scenario and scenario.workflow),
                         f"{tag}_{'on' if setting else 'off'}", total_mb, **prompt)
        finally:
            set_fix_every_run(url, False)
        outcome["on" if setting else "off"] = result, log.read_text()[start:]
    return outcome


def assert_red_then_green(outcome: dict, error: str, fix: str, reference: dict, scenario: str, core: str) -> None:
    (off, off_log), (on, on_log) = outcome["off"], outcome["on"]
    diff = max_abs_diff(on["tensors"], reference["tensors"])
    hint = [line for line in off_log.splitlines() if "this prompt failed with a known bug" in line]
    fixed = [line for line in on_log.splitlines() if "fixed a prompt on the server" in line]
    print(f"\n{scenario} | {core} | off: {off['error']} | on: {on['error']}, diff vs CPU {diff} | "
          f"log (off): {hint} | log (on): {fixed}")
    assert off["error"].startswith(error), off["error"]
    assert len(hint) == 1 and f"({fix})" in hint[0] and f"{FIX_EVERY_PROMPT_ENV}=1" in hint[0], off_log[-3000:]
    assert not any("fixed a prompt" in line for line in off_log.splitlines())
    assert on["error"] is None, on["error"]
    assert diff is not None and diff <= 1e-4
    assert len(fixed) == 1 and "4 loader(s) swapped" in fixed[0], on_log[-3000:]
    assert f"{fix} attached" in on_log


@needs_cores
def test_an_api_client_gets_int8_h3_fixed_by_the_setting(device_servers, device_int8_models, h3_int8_reference):
    scenario = named("seed 004 H3 int8 without _int_mm")
    device = SimulatedDevice(total_mb=budgets(scenario)["full"], int_mm=False)  # seed 004's server
    server = device_servers("0.33.0", True, device, device_int8_models[0])
    outcome = off_then_on(server, "server_side_int8", budgets(scenario)["partial"])
    assert_red_then_green(outcome, f"SamplerCustomAdvanced: {MPS_INT_MM_ERROR}", "int8_full_precision_mm",
                          h3_int8_reference, scenario.name, "0.33.0")


@needs_cores
def test_an_api_client_gets_the_h3_vae_fixed_by_the_setting(device_servers, h3_reference):
    core = "0.36/0.37 VAE"
    # the browser notice test's server (with the pinned frontend): ck_rope_device off, the VAE partly resident
    server = device_servers(core, True, without_ck_rope(), cache=True)
    # where no fix is needed (the whole VAE resident), turning it on changes nothing: bit-identical outputs
    whole = off_then_on(server, "server_side_vae_whole", RESERVE_MB + H3_RESIDENT_MB["full"])
    (off, _), (on, on_log) = whole["off"], whole["on"]
    assert off["error"] is None and on["error"] is None, (off["error"], on["error"])
    assert "fixed a prompt on the server" in on_log
    assert all(torch.equal(off["tensors"][name], on["tensors"][name]) for name in H3_COMPARED), \
        {name: (off["tensors"][name] - on["tensors"][name]).abs().max().item() for name in H3_COMPARED}
    # last, so the shared server is left at the budget it was started with (the notice test's)
    outcome = off_then_on(server, "server_side_vae", without_ck_rope().total_mb)
    assert_red_then_green(outcome, f"VAEDecode: {MIXED}", "vae_qk_norm_scale", h3_reference, "seed 000 H3 t2v", core)
    print(f"no fix needed (whole VAE resident): setting off and on bit-identical over {', '.join(H3_COMPARED)}")


@needs_cores
def test_an_api_client_gets_music3_fixed_by_the_setting(device_servers, music3_reference):
    """Music 3 as an API client posts it. On the simulated device neither Music 3 bug shows (graph capture needs CUDA;
    the #15607 placement is the process-wide cpu_device_cuda_query, on whatever the switch says), so the red control
    is the prompt itself: with the setting off it runs the stock loaders, with it on the pack's, which attach the
    Music 3 graph fixes; both complete, bit-identical to each other and equal to the all-CPU run."""
    scenario = named("seed 002 Music 3")
    server = device_servers(scenario.cores[0], True, SimulatedDevice(total_mb=budgets(named("seed 000 H3 t2v"))["full"]))
    outcome = off_then_on(server, "server_side_music3", budgets(scenario)["smallest"], scenario)
    (off, off_log), (on, on_log) = outcome["off"], outcome["on"]
    assert off["error"] is None and on["error"] is None, (off["error"], on["error"])
    assert "fixed a prompt on the server" not in off_log and not any("attached" in line for line in off["fix_lines"])
    fixed = [line for line in on_log.splitlines() if "fixed a prompt on the server" in line]
    assert len(fixed) == 1 and "CLIPLoader -> MiniMaxHotfixCLIPLoader" in fixed[0], on_log[-3000:]
    assert "music3_graph_buffers attached" in on_log or "music3_graph_capture attached" in on_log, on_log[-3000:]
    assert all(torch.equal(off["tensors"][name], on["tensors"][name]) for name in scenario.compared)
    diff = max_abs_diff(on["tensors"], music3_reference["tensors"], scenario.compared)
    assert diff is not None and diff <= 1e-4
    print(f"\nseed 002 Music 3 | {scenario.cores[0]} | off: completed | on: completed, {fixed[0].split(': ', 1)[1]} | "
          f"diff vs CPU {diff}; off and on bit-identical")


def test_two_users_at_once_each_by_their_own_setting(multi_user_server):
    """Alice has the setting on, bob off; their prompts, queued at the same moment, come back fixed and stock."""
    url, _, add_user = multi_user_server
    users = {name: add_user(name) for name in ("alice", "bob")}
    set_fix_every_run(url, True, users["alice"])
    set_fix_every_run(url, False, users["bob"])
    prompt = {"1": {"class_type": "VAELoader", "inputs": {"vae_name": "missing.safetensors"}},
              "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
              "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
              "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}}}

    def queue(user):
        return request(url + "/prompt", {"prompt": prompt, "client_id": user}, users[user])

    rounds = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(5):
            rounds.append(dict(zip(("alice", "bob"), pool.map(queue, ("alice", "bob")), strict=True)))
    for answers in rounds:
        types = {user: answer[1]["node_errors"]["1"]["class_type"] for user, answer in answers.items()}
        assert types == {"alice": "MiniMaxHotfixVAELoader", "bob": "VAELoader"}, answers
    # red control: without a user (no comfy-user header) the setting is nobody's, and the prompt stays stock
    status, answer = request(url + "/prompt", {"prompt": prompt})
    assert status != 200 and (answer.get("node_errors") or {}).get("1", {}).get("class_type") != \
        "MiniMaxHotfixVAELoader", answer
    print("\ntwo users at once, 5 rounds: alice (setting on) -> MiniMaxHotfixVAELoader, bob (off) -> VAELoader")


def test_a_malformed_prompt_gets_comfyuis_own_answer(multi_user_server):
    """Bodies the handler cannot read reach ComfyUI unchanged: with the setting on, ComfyUI answers exactly as with it
    off (its own validation error, or its own 500 where ComfyUI itself fails on the body), and the pack logs no
    failure of its own."""
    url, base, add_user = multi_user_server
    carol = add_user("carol")
    stock = {"1": {"class_type": "VAELoader", "inputs": {"vae_name": "missing.safetensors"}},
             "2": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}},
             "3": {"class_type": "VAEDecode", "inputs": {"samples": ["4", 0], "vae": ["1", 0]}},
             "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}}
    bodies = [{"prompt": {"1": {"class_type": 3}}}, {"prompt": {"1": {"inputs": {}}}},
              {"prompt": {"nodes": [], "links": []}}, {"prompt": []}, {"no_prompt": 1}, {"prompt": "text"},
              {"prompt": {"1": {"class_type": "VAELoader", "inputs": []}}}, {"prompt": {"1": None}}]
    answers = {}
    for setting in (False, True):
        set_fix_every_run(url, setting, carol)
        answers[setting] = [request(url + "/prompt", body, carol, parse=False)
                            for body in [*bodies, {"prompt": stock}]]
    log = (base / "comfyui.log").read_text()
    for body, off, on in zip(bodies, answers[False], answers[True], strict=False):
        assert on == off, (body, off, on)
    # red control: a prompt the handler does change gets another answer (ComfyUI names the pack's loader)
    assert answers[False][-1] != answers[True][-1]
    assert b"MiniMaxHotfixVAELoader" in answers[True][-1][1] and b"MiniMaxHotfixVAELoader" not in answers[False][-1][1]
    assert "MiniMax Hotfix: prompt left as it is: server-side fixing failed" not in log
    assert "An error occurred during the on_prompt_handler" not in log
