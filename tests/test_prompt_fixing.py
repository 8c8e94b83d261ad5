"""Server-side fixing's decisions and its handler's bounds, without ComfyUI (registry/prompt_fixing.py): the switch
(environment variable over the queuing user's setting), what a fixed body keeps, idempotence, the log line, the
hints a headless user reads, and the handler on every document the swap tool's fuzzing draws (never raises, never
changes anything but a prompt it can read, never changes its input). Through ComfyUI's own validation and real
servers: tests/test_server_side_fixing.py."""

from __future__ import annotations

import copy
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotfix_testing.workflow_fuzzing import api_seeds, examples, without_comfyui_only, workflows
from minimax_hotfix import swap_loaders
from minimax_hotfix.registry import prompt_fixing
from minimax_hotfix.registry.prompt_fixing import FIX_EVERY_PROMPT_ENV, PromptFixing, failure_hint, switched_on

STOCK_PROMPT = {
    "1": {"class_type": "VAELoader", "inputs": {"vae_name": "minimax_h3_video_vae.safetensors"}},
    "2": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "some.safetensors"}},
    "3": {"class_type": "VAEDecode", "inputs": {"samples": ["4", 0], "vae": ["1", 0]}},
    "4": {"class_type": "KSampler", "inputs": {"model": ["2", 0], "positive": ["5", 0]}},
    "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 1], "text": "a cat"}},
}
EXTRA = {"extra_pnginfo": {"workflow": {"nodes": [{"type": "VAELoader"}]}}, "client_id": "c"}
INT8_MESSAGE = "The operator 'aten::_int_mm' is not currently implemented for the MPS device."


def body(prompt=None) -> dict:
    return {"prompt": copy.deepcopy(STOCK_PROMPT if prompt is None else prompt), "extra_data": copy.deepcopy(EXTRA),
            "client_id": "c", "number": 3}


@pytest.mark.parametrize(("environment", "user", "fixed"), [
    (None, None, False), (None, False, False), (None, True, True),
    ("1", None, True), ("on", False, True), ("TRUE", None, True),
    ("0", True, False), ("off", True, False), ("  ", True, True), ("maybe", False, False),
])
def test_the_environment_variable_decides_over_the_users_setting(monkeypatch, environment, user, fixed):
    if environment is None:
        monkeypatch.delenv(FIX_EVERY_PROMPT_ENV, raising=False)
    else:
        monkeypatch.setenv(FIX_EVERY_PROMPT_ENV, environment)
    assert switched_on(user) is fixed
    sent = body()
    assert (PromptFixing().fixed_body(sent, user) is not sent) is fixed


def test_a_fixed_prompt_is_the_swap_and_nothing_else_changes(monkeypatch, caplog):
    monkeypatch.delenv(FIX_EVERY_PROMPT_ENV, raising=False)
    sent, fixing = body(), PromptFixing()
    kept = copy.deepcopy(sent)
    with caplog.at_level(logging.INFO, logger="minimax_hotfix"):
        fixed = fixing.fixed_body(sent, True)
    assert sent == kept, "the handler changed the body it was given"
    expected = copy.deepcopy(STOCK_PROMPT)
    swap_loaders.swap(expected)
    assert fixed["prompt"] == expected
    assert {key: value for key, value in fixed.items() if key != "prompt"} == \
        {key: value for key, value in sent.items() if key != "prompt"}
    assert fixed["prompt"]["1"]["class_type"] == "MiniMaxHotfixVAELoader"
    assert [r.getMessage() for r in caplog.records if "fixed a prompt" in r.getMessage()] == [
        "MiniMax Hotfix: fixed a prompt on the server: 1 loader(s) swapped, 2 Apply node(s) inserted (1 x "
        "MiniMaxHotfixApplyCLIP after CheckpointLoaderSimple, 1 x MiniMaxHotfixApplyModel after CheckpointLoaderSimple, "
        "1 x VAELoader -> MiniMaxHotfixVAELoader)"]
    # idempotent: a prompt that already goes through the pack comes back as it is, and is not counted
    again = fixing.fixed_body(fixed, True)
    assert again is fixed
    assert fixing.describe().endswith("2 prompt(s) queued with it on, 1 changed")


def test_the_status_line_names_the_switch(monkeypatch):
    monkeypatch.delenv(FIX_EVERY_PROMPT_ENV, raising=False)
    assert PromptFixing().describe().startswith("per user (setting \"MiniMax Hotfix: fix every run on this server\"")
    monkeypatch.setenv(FIX_EVERY_PROMPT_ENV, "1")
    assert PromptFixing().describe() == f"on for every prompt ({FIX_EVERY_PROMPT_ENV}); 0 prompt(s) queued with it " \
                                        "on, 0 changed"


def test_a_known_error_names_its_fix_and_the_switch():
    hint = failure_hint(INT8_MESSAGE, 'File "comfy/ldm/minimax/vae.py", line 3', through_pack=False)
    assert hint.startswith("MiniMax Hotfix: this prompt failed with a known bug (int8_full_precision_mm): at VAE "
                           "Decode: "), hint
    assert f"set {FIX_EVERY_PROMPT_ENV}=1 before starting ComfyUI" in hint
    through = failure_hint(INT8_MESSAGE, 'File "comfy/ldm/minimax/vae.py"', through_pack=True)
    assert "went through the pack" in through and FIX_EVERY_PROMPT_ENV not in through
    # red control: an error no fix repairs gets no line
    assert failure_hint("CUDA out of memory", "", through_pack=False) is None


def test_the_startup_hint_names_what_this_machine_needs(monkeypatch, caplog):
    monkeypatch.delenv(FIX_EVERY_PROMPT_ENV, raising=False)
    monkeypatch.setattr(prompt_fixing, "needed_model_fixes", lambda: ["int8_full_precision_mm"])
    with caplog.at_level(logging.INFO, logger="minimax_hotfix"):
        prompt_fixing.startup_hint()
        monkeypatch.setattr(prompt_fixing, "needed_model_fixes", lambda: [])
        prompt_fixing.startup_hint()  # red control: nothing needed, nothing said
        monkeypatch.setenv(FIX_EVERY_PROMPT_ENV, "1")
        prompt_fixing.startup_hint()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("MiniMax Hotfix: needed on this machine: int8_full_precision_mm.") and \
        FIX_EVERY_PROMPT_ENV in lines[0]
    assert lines[1].startswith("MiniMax Hotfix: server-side fixing is on")


MALFORMED_BODIES = [None, 3, "prompt", [], {}, {"prompt": None}, {"prompt": []}, {"prompt": "x"},
                    {"prompt": {"1": {"class_type": 3}}}, {"prompt": {"1": {"class_type": "VAELoader", "inputs": []}}},
                    {"prompt": {"1": None}}, {"prompt": {"1": {"inputs": {}}}},
                    {"prompt": {"nodes": [], "links": []}}]  # a UI-format workflow where the prompt goes


@pytest.mark.parametrize("sent", MALFORMED_BODIES, ids=repr)
def test_a_body_the_swap_cannot_read_goes_on_unchanged(sent):
    kept = copy.deepcopy(sent)
    assert PromptFixing().fixed_body(sent, True) is sent
    assert sent == kept


@without_comfyui_only
@settings(max_examples=examples(400), deadline=None)
@given(doc=st.one_of(workflows(), st.sampled_from(api_seeds())), extra=st.none() | st.just(EXTRA))
def test_the_handler_never_raises_and_changes_only_a_prompt_it_can_read(doc, extra):
    sent = {"prompt": doc, **({} if extra is None else {"extra_data": copy.deepcopy(extra)})}
    kept = copy.deepcopy(sent)
    fixed = PromptFixing().fixed_body(sent, True)
    assert sent == kept, "the handler changed its input"
    if fixed is sent:
        return
    assert swap_loaders.workflow_format(fixed["prompt"]) == "api"  # depth unchecked: the handler never recurses
    assert {key: value for key, value in fixed.items() if key != "prompt"} == \
        {key: value for key, value in sent.items() if key != "prompt"}
    assert PromptFixing().fixed_body(fixed, True) is fixed, "not idempotent"


def test_the_status_table_says_how_server_side_fixing_is_switched(monkeypatch):
    from minimax_hotfix.registry.status_table import status_table

    monkeypatch.setenv(FIX_EVERY_PROMPT_ENV, "1")
    table = status_table()
    (line,) = [line for line in table.splitlines() if line.startswith("server-side fixing ")]
    assert line.split(maxsplit=2)[2].startswith(f"on for every prompt ({FIX_EVERY_PROMPT_ENV});"), table


def test_a_machine_note_follows_the_startup_hint(monkeypatch, caplog):
    from minimax_hotfix import registry

    monkeypatch.delenv(FIX_EVERY_PROMPT_ENV, raising=False)
    fix = registry.all_fixes()["int8_full_precision_mm"]
    monkeypatch.setattr(prompt_fixing, "needed_model_fixes", lambda: [fix.id])
    with caplog.at_level(logging.INFO, logger="minimax_hotfix"):
        prompt_fixing.startup_hint()  # red control: a fix with nothing to say about this machine
        monkeypatch.setattr(fix, "machine_note", lambda: "this machine runs it slowly")
        prompt_fixing.startup_hint()
    notes = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert notes == [f"MiniMax Hotfix: {fix.id}: this machine runs it slowly"]


def test_registering_twice_adds_each_handler_once(comfyui, monkeypatch):
    import sys
    import types

    from minimax_hotfix.nodes import prompt_fixing as nodes_prompt_fixing

    server = types.SimpleNamespace(on_prompt_handlers=[], app=types.SimpleNamespace(middlewares=[], on_startup=[]))
    server.add_on_prompt_handler = server.on_prompt_handlers.append
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=server)))
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [h for h in root.handlers
                                           if not nodes_prompt_fixing.registered([h])])
    nodes_prompt_fixing.register_prompt_fixing()
    first = (len(root.handlers), len(server.on_prompt_handlers), len(server.app.middlewares),
             len(server.app.on_startup))
    nodes_prompt_fixing.register_prompt_fixing()
    again = (len(root.handlers), len(server.on_prompt_handlers), len(server.app.middlewares),
             len(server.app.on_startup))
    assert first[1:] == (1, 1, 1) and again == first
    assert nodes_prompt_fixing.registered(root.handlers)
    assert not nodes_prompt_fixing.registered([logging.NullHandler(), len])  # red control: others are not the pack's


def music3_gguf_prompt(loader: str) -> dict:
    """Seed 002's Music 3 prompt in API form: its GGUF text encoder from ``loader``, under dynamic VRAM."""
    return {"1": {"class_type": loader, "inputs": {"clip_name": "minimax_music3_text_encoder_pruned_Q4_0.gguf",
                                                   "type": "minimax", "device": "default"}},
            "2": {"class_type": "MiniMaxMusic3TextEncode", "inputs": {"clip": ["1", 0], "tags": "folk"}}}


@pytest.mark.parametrize("loader", ["CLIPLoaderGGUFDynamicVRAM", "DualCLIPLoaderGGUFDynamicVRAM",
                                    "TripleCLIPLoaderGGUFDynamicVRAM", "QuadrupleCLIPLoaderGGUFDynamicVRAM"])
def test_comfyui_gguf_dynamic_vram_loaders_get_their_apply_node(monkeypatch, loader):
    """Seed 002's own loader: the capture crash is repaired only through the Apply node after it."""
    monkeypatch.delenv(FIX_EVERY_PROMPT_ENV, raising=False)
    fixed = PromptFixing().fixed_body(body(music3_gguf_prompt(loader)), True)["prompt"]
    assert fixed["2"]["inputs"]["clip"] == ["3", 0]
    assert fixed["3"]["class_type"] == "MiniMaxHotfixApplyCLIP" and fixed["3"]["inputs"]["clip"] == ["1", 0]
    monkeypatch.delitem(swap_loaders.API_LOADER_OUTPUTS, loader)  # red control: a type the swap does not know
    changes = swap_loaders.swap_api(music3_gguf_prompt(loader))
    assert not changes and "output types are unknown in API format" in changes.warnings[0]


def raylight_h3_prompt(loader: str) -> dict:
    """raylight's MiniMax H3 prompt in API form, as its example workflows have it: Ray actors from ``loader`` into its
    parallel sampler (the text encoder and VAEs on stock loaders)."""
    return {"1": {"class_type": "RayInitializer", "inputs": {"GPU": 2, "ulysses_degree": 2}},
            "2": {"class_type": loader, "inputs": {"unet_name": "minimax_h3_fl2va_pruned_int8_convrot.safetensors",
                                                   "weight_dtype": "default", "ray_actors_init": ["1", 0]}},
            "3": {"class_type": "XFuserSamplerCustomAdvanced", "inputs": {"ray_actors": ["2", 0], "noise": ["9", 0]}}}


@pytest.mark.parametrize("loader", ["RayUNETLoader", "RayGGUFLoader"])
def test_raylights_loaders_get_the_ray_actors_apply_node(monkeypatch, loader):
    """Every prompt on the server: raylight's actors reach its sampler through the Apply (Ray actors) node, so the
    pack's fixes reach every actor's model. Red control: without the table entry, only the warning."""
    monkeypatch.delenv(FIX_EVERY_PROMPT_ENV, raising=False)
    fixed = PromptFixing().fixed_body(body(raylight_h3_prompt(loader)), True)["prompt"]
    assert fixed["3"]["inputs"]["ray_actors"] == ["4", 0]
    assert fixed["4"]["class_type"] == "MiniMaxHotfixApplyRayActors" and fixed["4"]["inputs"]["ray_actors"] == ["2", 0]
    monkeypatch.delitem(swap_loaders.API_LOADER_OUTPUTS, loader)
    changes = swap_loaders.swap_api(raylight_h3_prompt(loader))
    assert not changes.inserted and "output types are unknown in API format" in changes.warnings[0]


class ThirdPartyCLIPLoader:  # a multi-GPU subclass of a GGUF loader, say: a type no table names
    RETURN_TYPES = ("CLIP",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip_name": (["a.gguf"],), "type": (["minimax"],)}, "optional": {"device": (["cuda:1"],)}}


class ThirdPartyLoraLoader:  # passes the CLIP it takes on: its source gets the Apply node
    RETURN_TYPES = ("MODEL", "CLIP")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "clip": ("CLIP",), "strength": ("FLOAT", {"default": 1.0})}}


class ThirdPartyModelAndVAE:  # takes a MODEL, makes a new VAE
    RETURN_TYPES = ("MODEL", "VAE")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}


class BrokenInputs:
    RETURN_TYPES = ("CLIP",)

    @classmethod
    def INPUT_TYPES(cls):
        raise OSError("models folder gone")


def test_a_server_gives_any_loader_it_has_its_apply_node(comfyui, monkeypatch):
    """On a server every node type's outputs and inputs are known: a third-party loader no table names is fixed too."""
    import nodes
    from minimax_hotfix.nodes.node_types import loader_outputs

    for node_class in (ThirdPartyCLIPLoader, ThirdPartyLoraLoader, ThirdPartyModelAndVAE, BrokenInputs):
        monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, node_class.__name__, node_class)
    assert [loader_outputs(name) for name in ("ThirdPartyCLIPLoader", "ThirdPartyLoraLoader", "ThirdPartyModelAndVAE",
                                              "BrokenInputs", "NoSuchNode", "KSampler", "CLIPLoaderGGUFDynamicVRAM")] \
        == [["CLIP"], None, [None, "VAE"], None, None, None, ["CLIP"]]
    monkeypatch.delenv(FIX_EVERY_PROMPT_ENV, raising=False)
    prompt = {**music3_gguf_prompt("ThirdPartyCLIPLoader"),
              "3": {"class_type": "ThirdPartyLoraLoader", "inputs": {"model": ["5", 0], "clip": ["1", 0]}},
              "4": {"class_type": "VAEDecode", "inputs": {"vae": ["5", 1], "samples": ["2", 0]}},
              "5": {"class_type": "ThirdPartyModelAndVAE", "inputs": {"model": ["6", 0]}},
              "6": {"class_type": "UNETLoader", "inputs": {"unet_name": "m.safetensors", "weight_dtype": "default"}}}
    fixed = PromptFixing().fixed_body(body(prompt), True, loader_outputs)["prompt"]
    applied = {node["inputs"][node["class_type"].removeprefix("MiniMaxHotfixApply").lower()][0]: node["class_type"]
               for node in fixed.values() if node["class_type"].startswith("MiniMaxHotfixApply")}
    assert applied == {"1": "MiniMaxHotfixApplyCLIP", "5": "MiniMaxHotfixApplyVAE"}
    assert fixed["6"]["class_type"] == "MiniMaxHotfixUNETLoader"
    # red control: the table alone knows none of the third-party types
    unfixed = PromptFixing().fixed_body(body(prompt), True)["prompt"]
    assert not any(node["class_type"].startswith("MiniMaxHotfixApply") for node in unfixed.values())
