"""A real ComfyUI server for tests: started from a checkout on a free port, its own base directory (custom nodes,
models, output), stopped however the test ends."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 300


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
def running_comfyui(comfyui: Path, base: Path, *, input_directory: Path | None = None, env: dict | None = None):
    """Yields the URL of ``main.py --cpu`` from ``comfyui`` with ``--base-directory base`` (its custom_nodes/,
    models/, output/) once it answers; the log is ``base/comfyui.log``."""
    port = free_port()
    log_path = base / "comfyui.log"
    command = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
               "--disable-auto-launch", "--base-directory", str(base)]
    if input_directory is not None:
        command += ["--input-directory", str(input_directory)]
    with log_path.open("w") as log:
        server = subprocess.Popen(command, cwd=comfyui, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})})
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
