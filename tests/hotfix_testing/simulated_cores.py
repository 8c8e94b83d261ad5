"""Simulated ComfyUI cores: a temporary copy of the 0.33.0 tree with newer upstream files laid over it.

Each core is named for the release it stands for. Where a newer file needs a symbol that 0.33.0 lacks, a named
stand-in supplies a minimal version of it; ``describe(name)`` lists them, and the tests print that list.

Source: ``../shared/comfyui`` beside the project checkout (read-only; never copied into the repo).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED_COMFYUI = ROOT.parent / "shared" / "comfyui"
BASE = SHARED_COMFYUI / "0.33.0"
UPSTREAM = SHARED_COMFYUI / "upstream"
SIMULATED_CORE_ENV = "MINIMAX_HOTFIX_SIMULATED_CORE"  # set to the core's name in a process running on that core


@dataclass(frozen=True)
class StandIn:
    """Source text added to (or changed in) one file of the copy so that a newer overlay runs on the 0.33.0 tree."""

    name: str
    why: str
    path: str
    text: str
    prepend: bool = False
    replaces: str = ""  # when set, ``text`` takes the place of this exact text (found once) instead of being added


@dataclass(frozen=True)
class Core:
    name: str
    stands_for: str
    overlays: tuple[str, ...] = ()  # "<owner>/ComfyUI/<commit8>/<path>" under upstream/
    stand_ins: tuple[StandIn, ...] = field(default=())
    left_out: tuple[tuple[str, str], ...] = ()  # (overlay, why it cannot be combined with the 0.33.0 tree)


KITCHEN_INT8_DECODE = StandIn(
    "kitchen_int8_decode",
    "comfy_kitchen.int8_decode (newer comfy-kitchen than 0.33.0 pins): int8 decode kernel reported unavailable",
    "comfy/text_encoders/qwen35.py",
    "import sys as _sys, types as _types  # stand-in: kitchen_int8_decode\n"
    "if 'comfy_kitchen.int8_decode' not in _sys.modules:\n"
    "    _sys.modules['comfy_kitchen.int8_decode'] = _types.SimpleNamespace(is_available=lambda device: False)\n",
    prepend=True,
)

LLAMA_DECODE_HELPERS = StandIn(
    "llama_decode_helpers",
    "FixedKVCache, Int8FixedKVCache, apply_penalty, penalty_active, rope_matrix (newer llama.py): text generation "
    "only; the vision tower never reaches them, and a call says it hit a stand-in",
    "comfy/text_encoders/llama.py",
    "\n\n# stand-in: llama_decode_helpers (symbols of a newer llama.py that a newer qwen35.py imports)\n"
    "def _simulated_core_stand_in(*args, **kwargs):\n"
    "    raise NotImplementedError('simulated core: a stand-in of a newer llama.py symbol was called')\n"
    "class FixedKVCache(FixedKV):\n"
    "    def __init__(self, *args, **kwargs):\n"
    "        _simulated_core_stand_in()\n"
    "class Int8FixedKVCache(FixedKVCache):\n"
    "    pass\n"
    "apply_penalty = penalty_active = rope_matrix = _simulated_core_stand_in\n",
)

COMFY_ATTENTION = StandIn(
    "comfy_attention",
    "ComfyAttention (newer attention.py): a per-layer attention preference with no method chosen",
    "comfy/ldm/modules/attention.py",
    "\n\n# stand-in: comfy_attention (a newer attention.py's per-layer attention preference)\n"
    "class ComfyAttention:\n"
    "    method = None\n",
)

INT8_COMPUTE_QUERY = StandIn(
    "int8_compute_query",
    "comfy.model_management.supports_int8_compute (#16130, which the fixed ops.py calls from pick_operations): no "
    "int8 compute on MPS, as upstream answers by device type, nor on the simulated accelerator without _int_mm, "
    "which stands for MPS there",
    "comfy/model_management.py",
    "\n\n# stand-in: int8_compute_query (#16130's supports_int8_compute)\n"
    "def supports_int8_compute(device=None):\n"
    "    simulated = sys.modules.get('simulated_accelerator')\n"
    "    if simulated is not None and torch.device(device or get_torch_device()).type == simulated.DEVICE_TYPE:\n"
    "        return simulated.stats()['int_mm']\n"
    "    return not is_device_mps(device)\n",
)

MALLOC_GRAPH = StandIn(
    "malloc_graph",
    "malloc_graph_enabled/begin/end (a newer model_prefetch.py, which needs a newer comfy-aimdo than 0.33.0 pins): "
    "graph-scoped allocation reported off, as on a machine without comfy-aimdo",
    "comfy/model_prefetch.py",
    "\n\n# stand-in: malloc_graph (graph-scoped allocation of a newer model_prefetch.py, reported off)\n"
    "def malloc_graph_enabled(device):\n"
    "    return False\n"
    "def malloc_graph_begin(*args, **kwargs):\n"
    "    pass\n"
    "def malloc_graph_end(*args, **kwargs):\n"
    "    pass\n",
)
MALLOC_SCOPE = StandIn(
    "malloc_scope",
    "prefetch_queue_pop accepts the malloc_scope argument of a newer model_prefetch.py and ignores it",
    "comfy/model_prefetch.py",
    "enable_graph=False, generator=None, malloc_scope=None):",
    replaces="enable_graph=False, generator=None):",
)
PREFETCH_GENERATE_HELPERS = StandIn(
    "prefetch_generate_helpers",
    "malloc_graph_scope, pin_modules (a newer model_prefetch.py, which a newer qwen35.py's text generation calls): "
    "text generation only; the vision tower never reaches them, a scope does nothing and pinning says it hit a "
    "stand-in",
    "comfy/model_prefetch.py",
    "\n\n# stand-in: prefetch_generate_helpers (a newer model_prefetch.py's text-generation helpers)\n"
    "def malloc_graph_scope(device):\n"
    "    import contextlib\n"
    "    return contextlib.nullcontext()\n"
    "def pin_modules(*args, **kwargs):\n"
    "    raise NotImplementedError('simulated core: a stand-in of a newer model_prefetch.py symbol was called')\n",
)

LINEAR_INPUT_ACT_RMS_NORM = StandIn(
    "linear_input_act_rms_norm",
    "linear_input_act(..., act_weight, act_eps, residual, residual_scale) (newer ops.py, which the newer vae.py's "
    "decoder blocks call): no input act, the rms_norm input and the residual addcmul computed eagerly around "
    "0.33.0's function",
    "comfy/ops.py",
    "def linear_input_act(linear, x, input_act, act_weight=None, act_eps=0.0, residual=None, residual_scale=None):\n"
    "    # stand-in: linear_input_act_rms_norm (the newer signature, eager rms_norm and residual)\n"
    "    if input_act is None:\n"
    "        out = linear(x)\n"
    "    elif input_act == 'rms_norm':\n"
    "        import comfy.rmsnorm\n"
    "        out = linear(comfy.rmsnorm.rms_norm(x, act_weight, act_eps))\n"
    "    else:\n"
    "        out = _linear_input_act_0_33(linear, x, input_act)\n"
    "    return out if residual is None else torch.addcmul(residual, out, residual_scale)\n\n\n"
    "def _linear_input_act_0_33(linear, x, input_act):",
    replaces="def linear_input_act(linear, x, input_act):",
)

CORES = {
    core.name: core
    for core in (
        Core("0.33.0", "ComfyUI 0.33.0 as released"),
        Core("0.36/0.37 VAE", "ComfyUI 0.36/0.37: MiniMax H3 VAE hands qk_norm_scale to rms_rope as is (#16390)",
             ("Comfy-Org/ComfyUI/3bd3ca17/comfy/ldm/minimax/vae.py",), (LINEAR_INPUT_ACT_RMS_NORM,)),
        Core("fixed VAE", "a core with the call-site fix: qk_norm_scale.to(query.device)",
             ("Comfy-Org/ComfyUI/19315e86/comfy/ldm/minimax/vae.py",), (LINEAR_INPUT_ACT_RMS_NORM,)),
        Core("post-#15861 Music 3", "after Comfy Compiler #15861, before #16428: Music 3 AR without decode_buffers",
             ("Comfy-Org/ComfyUI/00a76cac/comfy/text_encoders/llama.py",
              "comfyanonymous/ComfyUI/bc8cb493/comfy/ldm/minimax_music/ar.py"),
             (MALLOC_GRAPH, MALLOC_SCOPE)),
        Core("fixed int8", "a core with #16130 and #16285: int8 _full_precision_mm honoured in linear_input_act",
             ("Comfy-Org/ComfyUI/0271a469/comfy/ops.py",), (INT8_COMPUTE_QUERY,)),
        Core("0.38 Qwen3-VL", "0.38 era: Qwen3-VL vision tower tables still built on the weight's or buffer's device",
             ("Comfy-Org/ComfyUI/06990860/comfy/text_encoders/qwen35.py",),
             (KITCHEN_INT8_DECODE, LLAMA_DECODE_HELPERS, COMFY_ATTENTION)),
        Core("fixed Music 3", "a core with #16428: the Music 3 AR loop passes init_decode_buffers(...) to Llama2_",
             ("Comfy-Org/ComfyUI/00a76cac/comfy/text_encoders/llama.py",
              "zoidypuh/ComfyUI/4441d221/comfy/ldm/minimax_music/ar.py"),
             (MALLOC_GRAPH, MALLOC_SCOPE)),
        Core("0.39 era", "0.39.0 era (zhongzichang caa09649, whose comfyui_version.py says 0.39.0): the newer ops.py, "
                         "H3 VAE and DiT, Qwen3-VL tower, Music 3 AR and llama.py together",
             tuple(f"zhongzichang/ComfyUI/caa09649/comfy/{path}" for path in (
                 "ops.py", "ldm/minimax/vae.py", "ldm/minimax/model.py", "text_encoders/qwen35.py",
                 "text_encoders/llama.py", "ldm/minimax_music/ar.py")),
             (INT8_COMPUTE_QUERY, MALLOC_GRAPH, MALLOC_SCOPE, PREFETCH_GENERATE_HELPERS, COMFY_ATTENTION),
             (("Comfy-Org/ComfyUI/033046cc/comfy/sd.py",
               ("imports modules 0.33.0 has no file for (comfy.storage, comfy.text_encoders.qwen_image21, "
                "comfy.text_encoders.ming_image, comfy.text_encoders.yue2: other models' text encoders) and "
                "comfy.model_prefetch.pause_malloc_graph: stand-ins would be whole models. It builds the H3 video "
                "VAE with the same mixed_precision_ops(quant, dtype) call as 0.33.0's sd.py (no full_precision_mm), "
                "which int8_full_precision_mm's 'MiniMax H3 video VAE' kind probes, and passes num_layers=, whose "
                "default (36) the overlaid vae.py takes")),)),
    )
}


def running_on_simulated_core() -> str | None:
    return os.environ.get(SIMULATED_CORE_ENV)


def available() -> bool:
    return BASE.is_dir()


def describe(name: str) -> str:
    core = CORES[name]
    lines = [f"simulated core {name!r}: {core.stands_for}"]
    lines += [f"  overlay {overlay}" for overlay in core.overlays]
    lines += [f"  stand-in {s.name} in {s.path}: {s.why}" for s in core.stand_ins]
    lines += [f"  not overlaid {overlay}: {why}" for overlay, why in core.left_out]
    return "\n".join(lines)


NO_TESTS_COLLECTED = 5  # pytest's exit code when nothing was selected

BUILT: list[str] = []  # the cores built in this process, for the test summary


def build_core(name: str, dest: Path) -> Path:
    """A writable ComfyUI tree for core ``name`` at ``dest`` (created; must not exist yet)."""
    core = CORES[name]
    BUILT.append(name)
    shutil.copytree(BASE, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for folder, _, files in os.walk(dest):
        for entry in files:
            path = Path(folder, entry)
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
        Path(folder).chmod(Path(folder).stat().st_mode | stat.S_IWUSR)
    for overlay in core.overlays:
        relative = Path(*Path(overlay).parts[3:])
        shutil.copyfile(UPSTREAM / overlay, dest / relative)
    for stand_in in core.stand_ins:
        target = dest / stand_in.path
        source = target.read_text(encoding="utf-8")
        if stand_in.replaces:
            assert source.count(stand_in.replaces) == 1, f"stand-in {stand_in.name}: {stand_in.path} has drifted"
            source = source.replace(stand_in.replaces, stand_in.text)
        elif stand_in.prepend:
            source = stand_in.text + source
        else:
            source += stand_in.text
        target.write_text(source, encoding="utf-8")
    return dest


def run_tests_on_every_core(pytest_args: list[str], at_once: int = 2) -> int:
    """Builds each core in a temporary folder and runs pytest there with ``--core NAME``, one process per core (the
    running ComfyUI is the core's tree), ``at_once`` at a time (the runs are in-process tests, one core busy each): the
    tests marked for that core, and their switched-off red controls (tests/conftest.py). Prints each core's output
    when it ends, with its outcome and seconds; returns non-zero if any failed."""
    failed = []
    with tempfile.TemporaryDirectory(prefix="simulated-cores-") as folder:

        def run(index_and_name):
            index, name = index_and_name
            started = time.monotonic()
            tree = build_core(name, Path(folder, str(index), "ComfyUI"))
            environment = {**os.environ, "COMFYUI_PATH": str(tree)}
            done = subprocess.run([sys.executable, "-m", "pytest", "--core", name, *pytest_args], cwd=ROOT,
                                  env=environment, check=False, capture_output=True, text=True)
            shutil.rmtree(tree)
            return name, done, time.monotonic() - started

        with ThreadPoolExecutor(max_workers=at_once) as pool:
            for name, done, seconds in pool.map(run, enumerate(CORES)):
                print(f"== simulated core {name!r}\n{done.stdout}{done.stderr}", end="", flush=True)
                if done.returncode not in (0, NO_TESTS_COLLECTED):  # the arguments may select no test for this core
                    failed.append(name)
                print(f"== simulated core {name!r}: {'FAILED' if name in failed else 'passed'} in {seconds:.0f} s",
                      flush=True)
    print(f"simulated cores: {len(CORES) - len(failed)} of {len(CORES)} passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_tests_on_every_core(sys.argv[1:]))
