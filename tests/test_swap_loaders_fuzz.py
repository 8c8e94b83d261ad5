"""Bad input never gives a traceback (tools/swap_loaders.py): mutated and generated UI and API workflows, the bundled
workflows and the official MiniMax templates damaged in ordinary ways, written with CRLF line ends and byte order
marks, go through the command line (in this process through ``main()``, and a sample in a subprocess). Each either
swaps, or exits 1 with exactly one line ``swap_loaders: error: <file>: ...``, the message ``validate`` gives the
library for the same document; the input is never changed, no output or temporary file is left after an error.
Every failing example the fuzzing found is kept in ``FOUND``; a red control shows the fuzz fails when one
validation check is removed. The other direction: every workflow drawn from the frontend's own workflow schema is
swapped (or has nothing to change), and the reverse gives back the same document and the same bytes. The swap tool's writes also run with the POSIX-only ``os`` names removed, as on
Windows, and no code the pack runs calls one unguarded."""

from __future__ import annotations

import ast
import contextlib
import copy
import io
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import swap_loaders as command_line  # tools/swap_loaders.py (tests/conftest.py puts tools/ on the path)
from hotfix_testing.workflow_fuzzing import (
    PACK_ROOT,
    examples,
    file_bytes,
    frontend_workflows,
    layouts,
    ui_seeds,
    without_comfyui_only,
    workflows,
)
from minimax_hotfix import swap_loaders

pytestmark = pytest.mark.stdlib  # the swap tool is standard library only: run 1 alone runs these

TOOL = PACK_ROOT / "tools" / "swap_loaders.py"
CLI_EXAMPLES = examples(1500)
SUBPROCESS_EXAMPLES = examples(60)
FRONTEND_EXAMPLES = examples(100)


def expected_error(source: Path, reverse: bool):
    """The library's answer for the same file: None where it swaps, else the WorkflowError message naming it."""
    try:
        doc, _ = command_line.read_workflow(source)
    except swap_loaders.WorkflowError as exc:
        return str(exc)
    try:
        swap_loaders.swap(doc, reverse=reverse)
    except swap_loaders.WorkflowError as exc:
        return f"{source}: {exc}"
    return None


def in_process(args: list[str]) -> tuple[int, str]:
    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        code = command_line.main(args)
    return code, stderr.getvalue()


def in_subprocess(args: list[str]) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-I", str(TOOL), *args], capture_output=True, text=True, check=False)
    return done.returncode, done.stderr


def check_command_line(data: bytes, reverse: bool, run) -> None:
    """Runs the tool on ``data`` as a file (output with -o beside it) and checks the outcome."""
    with tempfile.TemporaryDirectory() as folder:
        source, output = Path(folder, "workflow.json"), Path(folder, "out.json")
        source.write_bytes(data)
        code, stderr = run([str(source), "-o", str(output), *(["--reverse"] if reverse else [])])
        lines = stderr.splitlines()
        assert "Traceback" not in stderr, stderr
        assert source.read_bytes() == data, "the input changed"
        assert lines and all(line.startswith("swap_loaders: ") for line in lines), stderr
        error = expected_error(source, reverse)
        if error is not None:
            assert (code, lines) == (1, [f"swap_loaders: error: {command_line.one_line(error)}"])
            assert os.listdir(folder) == ["workflow.json"], "a partial output or temporary file"
            return
        assert code == 0, stderr
        if lines[-1] == f"swap_loaders: {source}: nothing to change; wrote nothing":
            assert os.listdir(folder) == ["workflow.json"]
            return
        assert lines[-1].endswith(f"; wrote {output}")
        assert sorted(os.listdir(folder)) == ["out.json", "workflow.json"]
        written = swap_loaders.parse_json(output.read_text(encoding="utf-8"))
        swap_loaders.validate(written)  # the tool writes only what it can read again


def cli_property(run, max_examples, phases=tuple(Phase), derandomize=False):
    @settings(max_examples=max_examples, phases=phases, derandomize=derandomize)
    @given(doc=workflows(), layout=layouts(), reverse=st.booleans())
    def check(doc, layout, reverse):
        check_command_line(file_bytes(doc, layout), reverse, run)

    return check


@without_comfyui_only
def test_every_input_swaps_or_fails_with_one_line_in_process():
    cli_property(in_process, CLI_EXAMPLES)()


@without_comfyui_only
def test_every_input_swaps_or_fails_with_one_line_in_a_subprocess():
    cli_property(in_subprocess, SUBPROCESS_EXAMPLES)()


@without_comfyui_only
@pytest.mark.filterwarnings("ignore:Generating overly large repr")  # the failing example is a whole template
def test_red_control_the_fuzz_fails_when_one_check_is_removed(monkeypatch):
    monkeypatch.setattr(swap_loaders, "_check_ui_link", lambda check, link, where: None)
    with pytest.raises(Exception) as failure:  # the first failing example, not shrunk (templates shrink slowly)
        # derandomized: the same examples whatever the run's seed, so the control cannot miss by chance (a CI run's
        # seed once drew no example the removed check guards)
        cli_property(in_process, CLI_EXAMPLES, phases=(Phase.generate,), derandomize=True)()
    assert not isinstance(failure.value, swap_loaders.WorkflowError)


@without_comfyui_only
@settings(max_examples=FRONTEND_EXAMPLES)
@given(doc=frontend_workflows(), layout=layouts())
def test_every_workflow_the_frontend_accepts_is_swapped_and_reversed_exactly(doc, layout):
    """Issue 31: the tool refused workflows ComfyUI's frontend opens. Drawn from the frontend's schema (see
    workflow_fuzzing.frontend_workflows), each is swapped, and the reverse gives the same document, key order
    included, and through the command line the same bytes."""
    swapped = copy.deepcopy(doc)
    changes = swap_loaders.swap(swapped)  # a WorkflowError fails the test with the tool's message
    back = copy.deepcopy(swapped)
    swap_loaders.swap(back, reverse=True)
    assert json.dumps(back) == json.dumps(doc)
    with tempfile.TemporaryDirectory() as folder:
        source, output, restored = (Path(folder, name) for name in ("workflow.json", "swapped.json", "back.json"))
        source.write_bytes(file_bytes(doc, layout))
        code, stderr = in_process([str(source), "-o", str(output)])
        assert code == 0, stderr
        if not changes:
            assert not output.exists()
            return
        assert in_process([str(output), "--reverse", "-o", str(restored)])[0] == 0
        assert restored.read_bytes() == source.read_bytes()


DEEP = '{"nodes": [], "links": [], "extra": ' + "[" * 5000 + "]" * 5000 + "}"
LOADER = {"id": 1, "type": "CLIPLoaderGGUF", "outputs": [{"type": "CLIP", "links": [1]}]}
USER = {"id": 2, "type": "CLIPTextEncode", "inputs": [{"type": "CLIP", "link": 1}]}
ISSUE_CASES = [  # the inputs the issue names: a traceback each before
    ("subgraphs [1, 'x', {'nodes': 5}]", {"nodes": [], "links": [], "definitions": {"subgraphs": [1, "x", {"nodes": 5}]}},
     False, "malformed UI workflow: definitions.subgraphs[0]: the subgraph is a number, expected an object"),
    ("node id a list", {"nodes": [{"id": [1], "type": "VAELoader"}], "links": []}, False,
     'malformed UI workflow: nodes[0]: "id" is a list, expected a number or a string'),
    ("node id an object", {"nodes": [{"id": {"a": 1}, "type": "VAELoader"}], "links": []}, False,
     'malformed UI workflow: nodes[0]: "id" is an object, expected a number or a string'),
    ("link id a list", {"nodes": [LOADER, USER], "links": [[[1], 1, 0, 2, 0, "CLIP"]]}, False,
     'malformed UI workflow: links[0]: "id" is a list, expected a number or a string'),
    ("output link an object", {"nodes": [{**LOADER, "outputs": [{"type": "CLIP", "links": [{"x": 1}]}]}, USER],
                               "links": [[1, 1, 0, 2, 0, "CLIP"]]}, False,
     'malformed UI workflow: node 1: "outputs"[0].links[0] is an object, expected a link id'),
    ("nested 5000 levels", DEEP, False, "nested more than 200 levels deep; no ComfyUI workflow is"),
]
FOUND = [  # a traceback each before: one case per class the fuzz property found on the tool before validation
    ("API _meta a list (reverse)", {"1": {"class_type": "MiniMaxHotfixApplyVAE", "_meta": ["x"]}}, True,
     'malformed API workflow: node 1: "_meta" is a list, expected an object'),
    ("API inputs a string", {"1": {"class_type": "VAELoader", "inputs": "x"}}, False,
     'malformed API workflow: node 1: "inputs" is a string, expected an object'),
    ("marker null (reverse)", {"nodes": [{"id": 3, "type": "MiniMaxHotfixApplyCLIP",
                                          "properties": {swap_loaders.INSERTED_KEY: None}}]}, True,
     'malformed UI workflow: node 3: "properties.minimax_hotfix_inserted" is null, expected an object'),
    ("marker a number (reverse)", {"nodes": [{"id": 3, "type": "MiniMaxHotfixApplyCLIP",
                                              "properties": {swap_loaders.INSERTED_KEY: 1.5}}]}, True,
     'malformed UI workflow: node 3: "properties.minimax_hotfix_inserted" is a number, expected an object'),
    ("output type an object", {"nodes": [{"id": 1, "type": "CLIPLoaderGGUF",
                                          "outputs": [{"type": {"a": 1}, "links": [1]}]}]}, False,
     'malformed UI workflow: node 1: "outputs"[0].type is an object, expected a string, a list of strings or a number'),
    ("link null", {"nodes": [{"id": 1, "type": "VAELoader"}], "links": [None]}, False,
     "malformed UI workflow: links[0]: the link is null, expected a list or an object"),
    ("link cut short", {"nodes": [LOADER, USER], "links": [[1, 1, 0]]}, False,
     ("malformed UI workflow: links[0]: the link is a list of 3, expected 6: id, origin_id, origin_slot, target_id, "
      "target_slot, type")),
    ("link object without its ends", {"nodes": [LOADER, USER], "links": [{"id": 1, "origin_id": 1}]}, False,
     ('malformed UI workflow: links[0]: "origin_slot" is missing, expected a link with id, origin_id, origin_slot, '
      "target_id, target_slot, type")),
    ("outputs a string", {"nodes": [{**LOADER, "outputs": "CLIP"}], "links": []}, False,
     'malformed UI workflow: node 1: "outputs" is a string, expected a list'),
    ("marker cut short", {"nodes": [{"id": 3, "type": "MiniMaxHotfixApplyCLIP",
                                     "properties": {swap_loaders.INSERTED_KEY: {"after": [1]}}}], "links": []}, True,
     ('malformed UI workflow: node 3: "properties.minimax_hotfix_inserted.after" is a list, expected '
      "[node id, output slot]")),
    ("API inputs a list", {"1": {"class_type": "CheckpointLoaderSimple", "inputs": ["x"]}}, False,
     'malformed API workflow: node 1: "inputs" is a list, expected an object'),
    ("subgraph without nodes", {"nodes": [], "definitions": {"subgraphs": [{"id": "s"}]}}, False,
     'malformed UI workflow: subgraph s: "nodes" is null, expected a list'),
    ("group nodes a list", {"nodes": [], "extra": {"groupNodes": {"g": {"nodes": 5}}}}, False,
     'malformed UI workflow: group node g: "nodes" is a number, expected a list'),
    ("input type an object", {"nodes": [{**USER, "inputs": [{"type": {"a": 1}, "link": 1}]}]}, False,
     'malformed UI workflow: node 2: "inputs"[0].type is an object, expected a string, a list of strings or a number'),
    ("marker counters of lists", {"nodes": [{"id": 3, "type": "MiniMaxHotfixApplyCLIP", "properties": {
        swap_loaders.INSERTED_KEY: {"after": [1, 0], "counters": {"root": [[1], 1]}}}}]}, True,
     ('malformed UI workflow: node 3: "properties.minimax_hotfix_inserted.counters.root" is a list, expected '
      "[last node id, last link id]")),
    ("not UTF-8", b'{"nodes": [], "x": "\xff"}', False, None),
    ("a line break in a node id", {"nodes": [{"id": "a\nb\u2028c", "type": "VAELoader", "properties": []}]}, False,
     'malformed UI workflow: node a\\x0ab\\u2028c: "properties" is a list, expected an object'),
    ("null (found by the fuzz: the depth check of the validator itself)", "null", False,
     ('unrecognised format: expected a ComfyUI workflow, either UI format (an object with a "nodes" list) or API '
      'format (an object of nodes, each with a "class_type")')),
]
SWAPS_NOW = [  # a traceback before (or, for links null, with the validator first written), now a swap or nothing to do
    ("API id of Unicode digits", {"\u00b2": {"class_type": "CheckpointLoaderSimple", "inputs": {}},
                                  "2": {"class_type": "KSampler", "inputs": {"model": ["\u00b2", 0]}}}, False),
    ("position of strings", {"nodes": [{**LOADER, "pos": ["a", "b"], "size": ["w"]}, USER],
                             "links": [[1, 1, 0, 2, 0, "CLIP"]]}, False),
    ("line breaks in a type and an id (API warning)", {"x\ny": {"class_type": "Loader\r\nX", "inputs": {}},
                                                       "2": {"class_type": "KSampler", "inputs": {"model": ["x\ny", 0]}}},
     False),
    ("links null (found by the fuzz)", {"nodes": [LOADER, USER], "links": None}, False),
    ("Apply node without outputs", {"nodes": [{"id": 3, "type": "MiniMaxHotfixApplyCLIP", "outputs": [], "properties": {
        swap_loaders.INSERTED_KEY: {"after": [1, 4]}}}, LOADER]}, True),
    # Refused until issue 31: what the frontend's workflow schema takes
    ("input type a list (options as the type)", {"nodes": [{**USER, "inputs": [{"type": ["CLIP"], "link": 1}]}]},
     False),
    ("marker counters of strings (reverse; last_node_id is a node id)", {"nodes": [{
        "id": 3, "type": "MiniMaxHotfixApplyCLIP", "properties": {
            swap_loaders.INSERTED_KEY: {"after": [1, 0], "counters": {"root": ["a", 1]}}}}]}, True),
]


def _bytes(content) -> bytes:
    return content if isinstance(content, bytes) else (content if isinstance(content, str)
                                                       else json.dumps(content)).encode("utf-8")


@pytest.mark.parametrize("run", [in_process, in_subprocess], ids=["main()", "subprocess"])
@pytest.mark.parametrize("name,content,reverse,message", ISSUE_CASES + FOUND, ids=[c[0] for c in ISSUE_CASES + FOUND])
def test_bad_input_found_by_hand_or_by_fuzzing_fails_with_one_line(run, name, content, reverse, message, tmp_path):
    source = tmp_path / "workflow.json"
    source.write_bytes(_bytes(content))
    code, stderr = run([str(source), *(["--reverse"] if reverse else [])])
    assert code == 1 and "Traceback" not in stderr
    assert stderr.startswith(f"swap_loaders: error: {source}: ") and stderr.count("\n") == 1
    if message is not None:
        assert stderr == f"swap_loaders: error: {source}: {message}\n"
    assert os.listdir(tmp_path) == ["workflow.json"] and source.read_bytes() == _bytes(content)
    check_command_line(_bytes(content), reverse, in_process)


@pytest.mark.parametrize("name,content,reverse", SWAPS_NOW, ids=[c[0] for c in SWAPS_NOW])
def test_inputs_that_gave_a_traceback_now_work(name, content, reverse):
    swap_loaders.validate(content, reverse)  # taken, not refused
    check_command_line(_bytes(content), reverse, in_process)


def test_the_library_refuses_what_the_command_line_refuses_and_changes_nothing():
    for _, content, reverse, message in ISSUE_CASES + FOUND:
        if isinstance(content, (str, bytes)):
            continue
        doc = copy.deepcopy(content)
        with pytest.raises(swap_loaders.WorkflowError) as refused:
            swap_loaders.swap(doc, reverse=reverse)
        assert command_line.one_line(str(refused.value)) == message and doc == content


# ---- Windows: no POSIX-only os names, CRLF and byte order marks ----

POSIX_ONLY = ("getuid", "getgid", "geteuid", "getegid", "getgroups", "chown", "fchown", "lchown", "setuid", "setgid",
              "fork", "killpg", "getpgid", "setsid", "uname", "statvfs", "mkfifo", "getloadavg", "sync", "nice")


@pytest.fixture
def windows_os(monkeypatch):
    """``os`` without the names Windows' os module lacks."""
    for name in POSIX_ONLY:
        monkeypatch.delattr(os, name, raising=False)


def _stock_workflow(layout: dict) -> bytes:
    doc = {"nodes": [{"id": 1, "type": "VAELoader", "properties": {"cnr_id": "comfy-core", "ver": "0.33.0",
                                                                   "Node name for S&R": "VAELoader"}}], "links": []}
    return file_bytes(doc, layout)


@pytest.mark.parametrize("layout", [{"indent": 2, "crlf": False, "bom": False}, {"indent": 2, "crlf": True, "bom": True},
                                    {"indent": None, "crlf": True, "bom": False}, {"indent": "\t", "crlf": False,
                                                                                   "bom": True}],
                         ids=["LF", "CRLF+BOM", "compact CRLF", "tabs+BOM"])
def test_writes_work_without_posix_os_names_and_keep_crlf_and_bom(layout, windows_os, tmp_path):
    source, existing = tmp_path / "flow.json", tmp_path / "existing.json"
    original = _stock_workflow(layout)
    source.write_bytes(original)
    existing.write_text("old")
    os.chmod(existing, 0o640)
    assert command_line.main([str(source), "-o", str(existing)]) == 0
    assert stat.S_IMODE(existing.stat().st_mode) == 0o640
    swapped = existing.read_bytes()
    assert swapped.startswith(b"\xef\xbb\xbf") == layout["bom"] and (b"\r\n" in swapped) == layout["crlf"]
    assert b"MiniMaxHotfixVAELoader" in swapped
    assert command_line.main([str(source), "--in-place"]) == 0
    assert source.read_bytes() == swapped
    assert command_line.main([str(source), "--in-place", "--reverse"]) == 0
    assert source.read_bytes() == original, "swap then reverse gives the same bytes, CRLF and BOM included"
    assert sorted(os.listdir(tmp_path)) == ["existing.json", "flow.json"]


def test_the_pack_calls_no_posix_only_os_name_unguarded():
    """Code the pack runs inside ComfyUI and the swap tool: a POSIX-only ``os`` name only where a hasattr guard
    sits in the same function (the swap tool's owner keeping)."""
    unguarded = []
    for path in sorted(PACK_ROOT.rglob("*.py")):
        relative = path.relative_to(PACK_ROOT)
        if relative.parts[0] in ("tests", "benchmarks") or relative.parts[0].startswith("."):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for function in [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.Module))]:
            guarded = {arg.value for call in ast.walk(function) if isinstance(call, ast.Call)
                       and getattr(call.func, "id", None) == "hasattr" for arg in call.args[1:]
                       if isinstance(arg, ast.Constant)}
            for node in ast.walk(function):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                        and node.attr in POSIX_ONLY and node.attr not in guarded):
                    unguarded.append(f"{relative}:{node.lineno}: os.{node.attr}")
    assert not sorted(set(unguarded)), sorted(set(unguarded))


def test_a_seed_of_every_kind_is_there():
    assert len(ui_seeds()) >= 40
