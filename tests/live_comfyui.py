"""A live ComfyUI server for tests: this pack, the checkout's own custom nodes, stand-in custom nodes the test
writes (packs the test ComfyUI lacks), empty model folders."""

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


def write_stand_ins(custom_nodes: Path) -> None:
    """ComfyUI-GGUF's CLIPLoaderGGUF as a stand-in custom node with the snapshot's inputs."""
    folder = custom_nodes / "comfyui_gguf_stand_in"
    folder.mkdir()
    types = json.loads(SPECS_FILE.read_text(encoding="utf-8"))["nodes"]["CLIPLoaderGGUF"]["input"]["required"]["type"][0]
    (folder / "__init__.py").write_text(STAND_IN_SOURCE % (types,), encoding="utf-8")


class ServerFailed(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http(url: str, body: dict | None = None):
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@contextlib.contextmanager
def comfyui_server(comfyui, base: Path):
    """Yields (url, object_info) of ComfyUI started with --cpu on a free port, base directory ``base``."""
    custom_nodes = base / "custom_nodes"
    custom_nodes.mkdir()
    write_stand_ins(custom_nodes)
    (custom_nodes / "minimax-hotfix").symlink_to(PACK_ROOT, target_is_directory=True)
    for entry in (Path(comfyui) / "custom_nodes").iterdir():
        if entry.resolve() != PACK_ROOT and (entry.is_dir() or entry.suffix == ".py"):
            (custom_nodes / entry.name).symlink_to(entry.resolve())
    port = _free_port()
    log = (base / "comfyui.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
         "--base-directory", str(base), "--input-directory", str(Path(comfyui) / "input")],
        cwd=comfyui, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if http(url + "/system_stats")[0] == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise ServerFailed("ComfyUI did not start:\n" + (base / "comfyui.log").read_text()[-4000:])
            time.sleep(1)
        object_info = json.loads(http(url + "/object_info")[1])
        if "MiniMaxHotfixVAELoader" not in object_info:
            raise ServerFailed("the pack did not load:\n" + (base / "comfyui.log").read_text()[-4000:])
        yield url, object_info
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
