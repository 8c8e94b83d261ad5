"""A real ComfyUI server for tests: started from a checkout on a free port, its own base directory (custom nodes,
models, output), stopped however the test ends."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

START_TIMEOUT_S = 300
RUN_TIMEOUT_S = 300
PACK_ROOT = Path(__file__).resolve().parents[1]
SPECS_FILE = Path(__file__).with_name("workflow_node_specs.json")

STAND_INS = {"CLIPLoaderGGUF"}  # nodes of packs the test ComfyUI lacks, defined by the test for validation
STAND_IN_SOURCE = '''"""Stand-in for ComfyUI-GGUF's CLIPLoaderGGUF (the pack's test suite): same inputs, validation only."""
import folder_paths


class CLIPLoaderGGUF:
    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load_clip"
    CATEGORY = "stand-in"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip_name": (folder_paths.get_filename_list("text_encoders"),), "type": (%r,)}}

    def load_clip(self, clip_name, type):
        raise RuntimeError("stand-in for ComfyUI-GGUF: validation only")


NODE_CLASS_MAPPINGS = {"CLIPLoaderGGUF": CLIPLoaderGGUF}
'''


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http(url: str, body: dict | None = None):
    """(status, body bytes) of a GET, or of a POST of ``body`` as JSON; HTTP errors are returned, not raised."""
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@contextlib.contextmanager
def running_comfyui(comfyui: Path, base: Path, *, input_directory: Path | None = None,
                    options: tuple[str, ...] = ()):
    """Yields the URL of ``main.py --cpu *options`` from ``comfyui`` with ``--base-directory base`` (its
    custom_nodes/, models/, output/) once it answers; the log is ``base/comfyui.log``."""
    port = free_port()
    log_path = base / "comfyui.log"
    command = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
               "--disable-auto-launch", "--base-directory", str(base), *options]
    if input_directory is not None:
        command += ["--input-directory", str(input_directory)]
    with log_path.open("w") as log:
        server = subprocess.Popen(command, cwd=comfyui, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    if http(url + "/system_stats")[0] == 200:
                        break
                except OSError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("ComfyUI did not start:\n" + log_path.read_text()[-4000:])
                time.sleep(1)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def install_custom_nodes(comfyui: Path, custom_nodes: Path, *extra: Path) -> None:
    """``custom_nodes``: this pack, the checkout's own custom nodes, the stand-ins and ``extra`` node folders."""
    custom_nodes.mkdir()
    stand_in = custom_nodes / "comfyui_gguf_stand_in"
    stand_in.mkdir()
    specs = json.loads(SPECS_FILE.read_text(encoding="utf-8"))["nodes"]
    (stand_in / "__init__.py").write_text(
        STAND_IN_SOURCE % (specs["CLIPLoaderGGUF"]["input"]["required"]["type"][0],), encoding="utf-8")
    (custom_nodes / "minimax-hotfix").symlink_to(PACK_ROOT, target_is_directory=True)
    for entry in (*(Path(comfyui) / "custom_nodes").iterdir(), *extra):
        if entry.resolve() != PACK_ROOT and (entry.is_dir() or entry.suffix == ".py"):
            (custom_nodes / entry.name).symlink_to(entry.resolve())


@contextlib.contextmanager
def comfyui_with_pack(comfyui: Path, base: Path, *extra_nodes: Path, options: tuple[str, ...] = ()):
    """Yields (url, object_info) of a running ComfyUI with ``install_custom_nodes`` in ``base``; fails when the
    pack did not load."""
    install_custom_nodes(comfyui, base / "custom_nodes", *extra_nodes)
    with running_comfyui(comfyui, base, input_directory=comfyui / "input", options=options) as url:
        object_info = json.loads(http(url + "/object_info")[1])
        if "MiniMaxHotfixVAELoader" not in object_info:
            raise RuntimeError("the pack did not load:\n" + (base / "comfyui.log").read_text()[-4000:])
        yield url, object_info


def run_prompt(url: str, prompt: dict, base: Path) -> dict:
    """Queues ``prompt`` and waits for its /history entry; returns it. Fails on a validation or execution error."""
    status, body = http(url + "/prompt", {"prompt": prompt, "client_id": "minimax-hotfix-tests"})
    assert status == 200, body.decode()
    prompt_id = json.loads(body)["prompt_id"]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        entry = json.loads(http(f"{url}/history/{prompt_id}")[1]).get(prompt_id)
        if entry and entry["status"].get("completed") is not None:
            assert entry["status"]["status_str"] == "success", (
                json.dumps(entry["status"]["messages"])[-3000:] + (base / "comfyui.log").read_text()[-4000:])
            return entry
        time.sleep(0.5)
    pytest.fail(f"prompt {prompt_id} did not finish in {RUN_TIMEOUT_S} s:\n" + (base / "comfyui.log").read_text()[-4000:])
