"""A real ComfyUI server for tests: started from a checkout on a free port, its own base directory (custom nodes,
models, output), stopped however the test ends."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from hotfix_testing.emulated_graphs import EMULATED_GRAPHS_ENV
from hotfix_testing.pinned_free_memory import PINNED_FREE_MEMORY_ENV
from minimax_hotfix.registry import DISABLE_ENV

# A server start or a prompt fails when its log has not grown for this long (the work's own pace, not a guess of the
# machine's speed: a busy machine only stretches the wait), or at once when the process or its prompt worker died.
STALLED_S = 300
WORKER_DIED = " (prompt_worker):"  # the line "Exception in thread Thread-N (prompt_worker):"
PACK_ROOT = Path(__file__).resolve().parents[2]
SIMULATED_DEVICE = PACK_ROOT / "tests" / "simulated_device"
# pinned memory would call torch.cuda.cudart(); fp32 everywhere so that the run compares with a --cpu run
SIMULATED_DEVICE_OPTIONS = ("--disable-pinned-memory", "--force-fp32", "--fp32-vae")


@functools.cache
def simulated_accelerator_module():
    """tests/simulated_device/simulated_accelerator.py (its names and settings), imported from tests/: that
    folder itself must stay off this process's ``sys.path``, where its stand-in ``torch_npu`` package would make ComfyUI and
    transformers, imported later by other tests, take this process for an Ascend machine and install the device."""
    return importlib.import_module("simulated_device.simulated_accelerator")  # the folder as a namespace package


@dataclass(frozen=True)
class SimulatedDevice:
    """Start the server on the simulated accelerator (tests/simulated_device) instead of ``--cpu``: ComfyUI adopts
    it through its Ascend path; ``total_mb`` per device (changed later through ``POST /simulated_device``)."""

    total_mb: float = 2048
    int_mm: bool = True
    current: int = 0  # the device ComfyUI loads models on (npu:current)
    # --force-fp32 also keeps text encoders on the CPU (ComfyUI's text_encoder_device wants fp16 on the device): a
    # test of a text encoder on the device turns it off and compares with a --cpu run in the same dtypes
    force_fp32: bool = True
    # ComfyUI's dynamic VRAM loader (ModelPatcherDynamic) over the stand-in comfy-aimdo
    # (tests/simulated_device/dynamic_vram); else the legacy loader, as ComfyUI falls back to on a non-NVIDIA device
    dynamic_vram: bool = False
    # MINIMAX_HOTFIX_DISABLE in the server, e.g. "ck_rope_device": that process-wide fix rescues a stock VAE as well,
    # so a server that must show the stock VAE's failure beside the pack switches it off
    switched_off: str = ""
    # its matmuls and convolutions differ from the CPU's in the last bit, as a real GPU's (simulated_accelerator)
    last_bit_differs: bool = False
    # its Music 3 AR loop on the emulated CUDA graphs (hotfix_testing/emulated_graphs.py, run by the test probe)
    emulated_graphs: bool = False

    @property
    def loader(self) -> str:
        return "dynamic" if self.dynamic_vram else "legacy"

    def options(self) -> tuple[str, ...]:
        options = tuple(option for option in SIMULATED_DEVICE_OPTIONS if self.force_fp32 or option != "--force-fp32")
        return (*options, "--enable-dynamic-vram") if self.dynamic_vram else options

    def environment(self) -> dict:
        simulated_accelerator = simulated_accelerator_module()
        folders = ([SIMULATED_DEVICE / "dynamic_vram"] if self.dynamic_vram else []) + [SIMULATED_DEVICE]
        path = os.pathsep.join(filter(None, (*map(str, folders), os.environ.get("PYTHONPATH"))))
        return {**os.environ, "PYTHONPATH": path, simulated_accelerator.TOTAL_MB_ENV: str(self.total_mb),
                simulated_accelerator.INT_MM_ENV: "1" if self.int_mm else "0",
                simulated_accelerator.CURRENT_ENV: str(self.current),
                simulated_accelerator.LAST_BIT_ENV: "1" if self.last_bit_differs else "0",
                **({DISABLE_ENV: self.switched_off} if self.switched_off else {}),
                **({EMULATED_GRAPHS_ENV: "1"} if self.emulated_graphs else {})}

@dataclass(frozen=True)
class CudaDevice:
    """Start the server on real CUDA (benchmarks/gpu_check.py, which sets each budget's ``--reserve-vram`` on the
    running server through the probe node); ``index`` other than 0 is ``--default-device index`` (the other devices stay visible, but
    ComfyUI renumbers them so that this one is ``cuda:0`` in the server). fp32 and TF32 off, so that outputs compare
    with a ``--cpu`` run; ``text_encoder``: text encoders on the GPU too, in fp32 (``--fp32-text-enc`` instead of
    ``--force-fp32``, which keeps them on the CPU). Its free memory reads as if it were alone on the GPU
    (``PINNED_FREE_MEMORY_ENV``): the check runs servers side by side."""

    index: int = 0
    text_encoder: bool = False
    dynamic_vram: bool = False  # ComfyUI's default on NVIDIA; else --disable-dynamic-vram (the legacy loader)

    def options(self) -> tuple[str, ...]:
        default = ("--default-device", str(self.index)) if self.index else ()
        legacy = () if self.dynamic_vram else ("--disable-dynamic-vram",)
        return ("--fp32-text-enc" if self.text_encoder else "--force-fp32", "--fp32-vae", *default, *legacy)

    def environment(self) -> dict:
        return {**os.environ, "NVIDIA_TF32_OVERRIDE": "0", PINNED_FREE_MEMORY_ENV: "1"}


# nodes of packs the test ComfyUI lacks, defined by the tests (tests/comfyui_gguf_stand_in: ComfyUI-GGUF's loaders)
STAND_INS = {"CLIPLoaderGGUF", "CLIPLoaderGGUFDynamicVRAM", "UnetLoaderGGUF"}
GGUF_STAND_IN = Path(__file__).resolve().parents[1] / "comfyui_gguf_stand_in"


# The frontends the browser tests run on: the one ComfyUI's requirements pin (0.33.0: 1.49.6), and the newest release,
# which tools/test.sh installs beside .venv-comfyui and ComfyUI serves with --front-end-root
FRONTENDS = ("pinned", "comfyui-frontend-package-1.58.1")


def front_end_options(frontend: str) -> tuple[str, ...]:
    """ComfyUI's options to serve ``frontend`` (one of FRONTENDS)."""
    if frontend == "pinned":
        return ()
    root = Path(sys.prefix) / "extra" / frontend / "comfyui_frontend_package" / "static"
    if not root.is_dir():
        pytest.skip(f"needs {root}: tools/test.sh installs it with .venv-comfyui")
    return ("--front-end-root", str(root))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http(url: str, body: dict | bytes | None = None):
    """(status, body bytes) of a GET, or of a POST of ``body`` as JSON (bytes: as they are); HTTP errors are
    returned, not raised."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class LogProgress:
    """Whether a server's log has stopped growing for ``STALLED_S``."""

    def __init__(self, log: Path):
        self.log, self.size, self.since = log, -1, time.monotonic()

    def stalled(self) -> bool:
        size = self.log.stat().st_size if self.log.exists() else 0
        if size != self.size:
            self.size, self.since = size, time.monotonic()
        return time.monotonic() - self.since > STALLED_S


@contextlib.contextmanager
def running_comfyui(comfyui: Path, base: Path, *, input_directory: Path | None = None,
                    options: tuple[str, ...] = (), device: SimulatedDevice | CudaDevice | None = None):
    """Yields the URL of ``main.py --cpu *options`` (on ``device``: without ``--cpu``) from ``comfyui`` with
    ``--base-directory base`` (its custom_nodes/, models/, output/) once it answers; the log is
    ``base/comfyui.log``."""
    port = free_port()
    log_path = base / "comfyui.log"
    placement = device.options() if device else ("--cpu",)
    if not any(option.startswith("--cache-") for option in options):
        # ComfyUI's default cache (RAM pressure) evicts models when free RAM is low: a busy machine would change
        # what a test that relies on kept models sees. The classic cache keeps them whatever the load.
        options = (*options, "--cache-classic")
    command = [sys.executable, "main.py", *placement, "--listen", "127.0.0.1", "--port", str(port),
               "--disable-auto-launch", "--base-directory", str(base), *options]
    if input_directory is not None:
        command += ["--input-directory", str(input_directory)]
    with log_path.open("w") as log:
        server = subprocess.Popen(command, cwd=comfyui, stdout=log, stderr=subprocess.STDOUT,
                                  env=device.environment() if device else None)
        url = f"http://127.0.0.1:{port}"
        try:
            progress = LogProgress(log_path)
            while True:
                try:
                    if http(url + "/system_stats")[0] == 200:
                        break
                except OSError:
                    pass
                if server.poll() is not None or progress.stalled():
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


def install_custom_nodes(comfyui: Path, custom_nodes: Path, *extra: Path, pack: bool = True) -> None:
    """``custom_nodes``: this pack (unless ``pack`` is false), the checkout's own custom nodes, the stand-ins and
    ``extra`` node folders."""
    custom_nodes.mkdir()
    (custom_nodes / GGUF_STAND_IN.name).symlink_to(GGUF_STAND_IN, target_is_directory=True)
    if pack:
        (custom_nodes / "minimax-hotfix").symlink_to(PACK_ROOT, target_is_directory=True)
    for entry in (*(Path(comfyui) / "custom_nodes").iterdir(), *extra):
        if entry.resolve() != PACK_ROOT and (entry.is_dir() or entry.suffix == ".py"):
            (custom_nodes / entry.name).symlink_to(entry.resolve())


@contextlib.contextmanager
def comfyui_with_pack(comfyui: Path, base: Path, *extra_nodes: Path, options: tuple[str, ...] = (),
                      device: SimulatedDevice | CudaDevice | None = None, pack: bool = True):
    """Yields (url, object_info) of a running ComfyUI with ``install_custom_nodes`` in ``base`` (on ``device``, with
    its ``/simulated_device`` route); fails when the pack did not load (or, with ``pack`` false, did)."""
    if isinstance(device, SimulatedDevice):
        extra_nodes = (*extra_nodes, SIMULATED_DEVICE / "simulated_device_routes")
    install_custom_nodes(comfyui, base / "custom_nodes", *extra_nodes, pack=pack)
    with running_comfyui(comfyui, base, input_directory=comfyui / "input", options=options, device=device) as url:
        object_info = json.loads(http(url + "/object_info")[1])
        if ("MiniMaxHotfixVAELoader" in object_info) is not pack:
            raise RuntimeError(f"the pack {'did not load' if pack else 'loaded'}:\n"
                               + (base / "comfyui.log").read_text()[-4000:])
        yield url, object_info


def finished_prompt(url: str, prompt: dict, base: Path) -> dict:
    """Queues ``prompt`` and waits for its /history entry, completed or failed; returns it. Fails on a validation
    error or when it does not finish in time."""
    status, body = http(url + "/prompt", {"prompt": prompt, "client_id": "minimax-hotfix-tests"})
    assert status == 200, body.decode()
    prompt_id = json.loads(body)["prompt_id"]
    log = base / "comfyui.log"
    progress = LogProgress(log)
    while not progress.stalled():
        entry = json.loads(http(f"{url}/history/{prompt_id}")[1]).get(prompt_id)
        if entry and entry["status"].get("completed") is not None:
            return entry
        if WORKER_DIED in log.read_text():
            pytest.fail(f"ComfyUI's prompt worker died; prompt {prompt_id} will never run:\n" + log.read_text()[-4000:])
        time.sleep(0.25)
    pytest.fail(f"prompt {prompt_id}: nothing logged for {STALLED_S} s:\n" + log.read_text()[-4000:])


def unload_models(url: str, free_memory: bool = True) -> None:
    """ComfyUI's ``/free`` (unload every model; with ``free_memory`` also clear the node cache), done before this
    returns (the probe node's ``/probe/unload_models``), so that the next prompt's loads do not depend on timing."""
    status, body = http(url + "/probe/unload_models", {"free_memory": free_memory})
    assert status == 200, body.decode()


def run_prompt(url: str, prompt: dict, base: Path) -> dict:
    """``finished_prompt`` that also fails on an execution error."""
    entry = finished_prompt(url, prompt, base)
    assert entry["status"]["status_str"] == "success", (
        json.dumps(entry["status"]["messages"])[-3000:] + (base / "comfyui.log").read_text()[-4000:])
    return entry
