"""Registry guarantee: no fix changes a seeded result.

Every path that runs fix code (pack load, detection, attach and the loaded model's forward, first-use probes, the
Status node's table, process-wide install) leaves the global random state as it found it: torch's CPU generator,
CUDA's where present, Python's ``random`` and NumPy's (``tests/hotfix_testing/random_state.py``); and the draws a seeded run makes
afterwards equal those of the same seed without the pack. Without ComfyUI the paths run on the stand-in patcher
and the pack's own tiny models; with the ``comfyui`` fixture, on ComfyUI's ModelPatcher, its model classes and the
pack's real nodes. The run's summary lists which paths each fix went through (``tests/conftest.py``); detection is
checked for every fix (``test_detection_keeps_the_random_state`` is parametrized over them all).

Red control: a fix made to draw one random number in detect, attach or a probe fails the check
(``test_red_*``). transformers 5.19's first-use probe inside a seeded ``generate()`` is checked in
tests/test_transformers_static_cache.py (``test_affected_seeded_generate_*``), which runs it on that version.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hotfix_testing import child_pythonpath
from hotfix_testing.counting_fix import CountingFix
from hotfix_testing.patchers import ComfyBackend, StandInBackend
from hotfix_testing.random_state import COVERED_PATHS, changed_generators, random_state, seed_everything, seeded_draws
from hotfix_testing.registry_state import forget_detection
from minimax_hotfix import registry as pack_registry
from minimax_hotfix.contract import State
from minimax_hotfix.patches import ck_rope_device, int8_full_precision_mm, transformers_static_cache
from minimax_hotfix.registry.status_table import status_table

ROOT = Path(__file__).resolve().parents[1]
MODEL_TARGETS = ("vae", "clip", "model")

pytestmark = pytest.mark.usefixtures("fresh_detection")


def keeps_random_state(fix_ids, path: str, run, without_pack=lambda: None):
    """Seeds every watched generator and runs ``run()``, then again with ``without_pack()`` (the same work without
    the pack; by default nothing) in its place: fails if the random states after them differ or a seeded run's
    draws afterwards do. Records ``path`` as covered for ``fix_ids``; returns both results."""
    seed_everything()
    expected = without_pack()
    state_without, draws_without = random_state(), seeded_draws()
    seed_everything()
    result = run()
    changed = changed_generators(state_without, random_state())
    assert not changed, f"{path} ({', '.join(fix_ids)}) changed the global random state of {', '.join(changed)}"
    assert seeded_draws() == draws_without, f"{path} ({', '.join(fix_ids)}): a seeded run after it draws differently"
    for fix_id in fix_ids:
        COVERED_PATHS[fix_id].append(path)
    return result, expected


def with_comfyui() -> bool:
    return bool(os.environ.get("COMFYUI_PATH"))


def tiny_model():
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.ReLU(), nn.Linear(4, 2, device="meta"))
    return model.to_empty(device="cpu").apply(
        lambda m: [p.data.copy_(torch.randn(p.shape, generator=generator)) for p in m.parameters(recurse=False)])


# -- pack load (a fresh interpreter: the pack imported, its fixes detected and installed) -----------------------

PACK_LOAD = """
import asyncio, json, os, sys
from hotfix_testing.random_state import changed_generators, random_state, seed_everything
comfyui = os.environ.get("COMFYUI_PATH")
if comfyui:
    import torch
    from comfy.cli_args import args
    args.cpu = not torch.cuda.is_available()
    import nodes
seed_everything()
before = random_state()
if comfyui:  # the real entry point, as ComfyUI loads a custom node folder: nodes, detection, process-wide install
    assert asyncio.run(nodes.load_custom_node({root!r}, ignore=set(nodes.NODE_CLASS_MAPPINGS)))
    registry = sys.modules["minimax_hotfix"].registry
else:  # the entry point exports nothing outside ComfyUI; the registry's start-up steps, as it would run them
    from minimax_hotfix import registry
    registry.install_process_fixes()
{extra}
print(json.dumps({{"changed": changed_generators(before, random_state()), "fixes": sorted(registry.all_fixes()),
                   "installed": registry.install_process_fixes()}}))
"""


def load_pack_in_a_fresh_interpreter(extra: str = "") -> dict:
    code = PACK_LOAD.format(root=str(ROOT), extra=extra)
    env = {k: v for k, v in os.environ.items() if k != pack_registry.DISABLE_ENV}
    env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH"))
    # cwd: ComfyUI's folder, which python -c puts first on the path, as "python main.py" run there (or / without it)
    result = subprocess.run([sys.executable, "-c", code], cwd=os.environ.get("COMFYUI_PATH") or "/", env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_pack_load_keeps_the_random_state(request):
    if with_comfyui():
        request.getfixturevalue("comfyui")
    loaded = load_pack_in_a_fresh_interpreter()
    assert loaded["changed"] == [], f"loading the pack changed the random state of {loaded['changed']}"
    assert set(loaded["fixes"]) == set(pack_registry.all_fixes())
    where = "ComfyUI's custom node loader" if with_comfyui() else "the registry's start-up steps"
    process = {fix.id for fix in pack_registry.fixes_for("process")}
    for fix_id in loaded["fixes"]:
        steps = "import" + (", detection" if fix_id in process else "") + (
            ", process-wide install" if fix_id in loaded["installed"] else "")
        COVERED_PATHS[fix_id].append(f"pack load ({where}: {steps})")


def test_red_pack_load_that_draws_is_caught():
    loaded = load_pack_in_a_fresh_interpreter(extra="registry.all_fixes(); import random; random.random()")
    assert loaded["changed"] == ["random"]


# -- detection, the Status node's table, process-wide install --------------------------------------------------

@pytest.mark.parametrize("fix_id", sorted(pack_registry.all_fixes()))
def test_detection_keeps_the_random_state(fix_id):
    fix = pack_registry.all_fixes()[fix_id]
    keeps_random_state([fix_id], "detection (detect)", fix.detect)
    keeps_random_state([fix_id], "detection through the registry (status)", lambda: pack_registry.status(fix))


def test_status_table_keeps_the_random_state(request):
    every = sorted(pack_registry.all_fixes())
    keeps_random_state(every, "the Status node's table (fresh detection)", status_table)
    if with_comfyui():
        request.getfixturevalue("comfyui")
        from minimax_hotfix.nodes import NODE_CLASS_MAPPINGS

        forget_detection(pack_registry)
        node = NODE_CLASS_MAPPINGS["MiniMaxHotfixStatus"]()
        keeps_random_state(every, "the real MiniMaxHotfixStatus node (fresh detection)", node.report)


@pytest.mark.parametrize("fix_id", sorted(fix.id for fix in pack_registry.fixes_for("process")))
def test_process_wide_install_keeps_the_random_state(fix_id, request):
    fix = pack_registry.all_fixes()[fix_id]
    if with_comfyui():  # in the run with ComfyUI it is importable here, whichever test ran first
        request.getfixturevalue("comfyui")
        forget_detection(pack_registry)
    if pack_registry.status(fix).state is State.NOT_APPLICABLE:
        pytest.skip(f"{fix_id} is not applicable here: {pack_registry.status(fix).reason}")
    fix.uninstall()
    try:
        keeps_random_state([fix_id], "process-wide install and uninstall", lambda: (fix.install(), fix.uninstall()))
        keeps_random_state([fix_id], "install_process_fixes (registry)", pack_registry.install_process_fixes)
    finally:
        pack_registry.uninstall_process_fixes()


# -- first-use probes --------------------------------------------------------------------------------------------

def sampled_ids(model, prompt):
    torch.manual_seed(7)
    return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                          do_sample=True, cache_implementation="static", pad_token_id=0,
                          disable_compile=True)[0].tolist()


def test_static_cache_first_generate_probe_keeps_a_seeded_result(monkeypatch):
    """The guard's first generate() probes the running transformers; the seeded ids equal a run without the pack."""
    import transformers

    shim = transformers_static_cache
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(config).eval()
    prompt = torch.tensor([[1, 2, 3]])
    monkeypatch.setattr(shim.FIX, "_verdict", None)

    def installed_then_first_generate():
        shim.FIX.install()
        return sampled_ids(model, prompt)

    try:
        with_pack, without_pack = keeps_random_state(
            [shim.FIX_ID], f"install, then the first-use probe in a seeded generate() (transformers "
                           f"{transformers.__version__})", installed_then_first_generate,
            without_pack=lambda: sampled_ids(model, prompt))
        assert shim.FIX._verdict is not None, "the first generate() did not probe"
    finally:
        shim.FIX.uninstall()
    assert with_pack == without_pack


def test_int8_compute_probe_keeps_the_random_state():
    from minimax_hotfix.diagnostics.self_tests.int8_full_precision_mm import forget_int8_probes
    from minimax_hotfix.kernels.int8_full_precision_mm import int8_compute_available

    forget_int8_probes()
    keeps_random_state([int8_full_precision_mm.FIX_ID], "first-use probe: int8 compute on cpu and meta",
                       lambda: (int8_compute_available("cpu"), int8_compute_available("meta")))


def test_rope_first_wrapped_call_keeps_the_random_state():
    """ck_rope_device's wrapper on its first call: a stray CPU scale moved to q's (FakeTensor cuda) device, logged."""
    import comfy_kitchen

    from minimax_hotfix.diagnostics.kitchen import real_kitchen_routing, rope_inputs
    from minimax_hotfix.kernels.fake_cuda import fake_cuda_mode, on_fake_cuda

    fix = ck_rope_device.FIX
    fix.uninstall()  # a fresh installation: its first move is logged
    fix.install()
    def first_call():
        with fake_cuda_mode() as mode, real_kitchen_routing():
            q, k, table, scale = rope_inputs(lambda t: on_fake_cuda(mode, t))
            comfy_kitchen.rms_rope_split_half(q, k, table, scale, rot_dim=32)

    try:
        keeps_random_state([fix.id], "first wrapped kitchen call (stray scale moved, logged)", first_call)
    finally:
        fix.uninstall()


def test_transformers_qwen3vl_attach_and_forward_keep_the_random_state():
    from minimax_hotfix import api
    from minimax_hotfix.diagnostics.self_tests import transformers_qwen3vl_pos_embed as tower_kit
    from minimax_hotfix.patches import transformers_qwen3vl_pos_embed as fix

    if fix.reference_tower_class() is None:
        pytest.skip("transformers without Qwen3-VL")
    tower, _ = keeps_random_state([fix.FIX.id], "tiny tower build (tiny_tower)", tower_kit.tiny_tower)
    pixels, grid = tower_kit.tiny_inputs()
    with torch.no_grad():
        reference = tower_kit.outputs(tower(pixels, grid))
        attached, _ = keeps_random_state([fix.FIX.id], "attach (attach_to_transformers_model) and forward",
                                      lambda: (api.attach_to_transformers_model(tower), tower(pixels, grid))[1])
    api.detach_from_transformers_model(tower)
    assert all(map(torch.equal, tower_kit.outputs(attached), reference))


# -- attach, load, forward, unload (the registry path the loaders and Apply nodes take) -------------------------

def attach_run_detach(backend, patcher, fixes, run):
    for fix in fixes:
        fix.attach(patcher, pack_registry.key_for(fix))
    backend.load(patcher)
    try:
        with torch.no_grad():
            return run()
    finally:
        backend.unload(patcher)
        for fix in fixes:
            fix.detach(patcher, pack_registry.key_for(fix))


@pytest.mark.parametrize("target", MODEL_TARGETS)
def test_registry_attach_keeps_the_random_state(target):
    """``attach_fixes`` as the loaders call it, on the stand-in patcher; without ComfyUI no per-model fix applies,
    so this is the registry's own path with whichever fixes do."""
    backend = StandInBackend()
    patcher = backend.patcher(tiny_model())
    attached, _ = keeps_random_state([], f"attach_fixes({target!r})", lambda: pack_registry.attach_fixes(patcher, target))
    for fix_id in attached:
        COVERED_PATHS[fix_id].append(f"attach_fixes({target!r}) on the stand-in patcher")
    pack_registry.detach_fixes(patcher, target)


def comfy_models():
    """Per fix: a model of the running ComfyUI holding what the fix looks for (cheap ones), else a tiny model."""
    import comfy.ops
    import comfy.text_encoders.minimax_music as music

    from hotfix_testing.music3_support import TINY_MUSIC3_CONFIG
    from minimax_hotfix.diagnostics.self_tests.qwen3vl_pos_embed import tiny_pixels
    from minimax_hotfix.diagnostics.tiny_qwen3vl import TINY_QWEN3VL_GRID, tiny_qwen3vl_tower
    from minimax_hotfix.kernels.int8_full_precision_mm import tiny_int8_linear

    int8_layer = tiny_int8_linear(comfy.ops, 64, 16, full_precision_mm=False)
    music3 = lambda: music.MiniMaxMusic3TEModel(device="cpu", model_options={}, projection_config=TINY_MUSIC3_CONFIG)  # noqa
    return {
        "qwen3vl_pos_embed": (tiny_qwen3vl_tower(),
                              lambda tower: tower(tiny_pixels(),
                                                  torch.tensor(TINY_QWEN3VL_GRID))),
        "int8_full_precision_mm": (nn.Sequential(int8_layer), lambda model: model(torch.ones(2, 64))),
        "music3_graph_buffers": (music3(), lambda model: None),
        "music3_graph_capture": (music3(), lambda model: None),
    }


def test_attach_on_comfyui_keeps_the_random_state(comfyui):
    """Every per-model fix attached to ComfyUI's real ModelPatcher (whatever its state here, so its injection code
    runs), the model loaded by model_management, run, unloaded, the fix detached; then the real Apply nodes."""
    from minimax_hotfix.nodes import NODE_CLASS_MAPPINGS

    backend = ComfyBackend()
    models = comfy_models()
    for fix in [f for f in pack_registry.all_fixes().values() if set(f.targets) & set(MODEL_TARGETS)]:
        with torch.random.fork_rng(devices=[]):  # the test's own models: built outside the watched region
            model, run = models.get(fix.id, (tiny_model(), lambda m: m(torch.ones(1, 4))))
        patcher = backend.patcher(model)
        keeps_random_state([fix.id], "attach on ComfyUI's ModelPatcher, load, forward, unload, detach",
                           lambda patcher=patcher, fix=fix, run=run, model=model:
                           attach_run_detach(backend, patcher, [fix], lambda: run(model)))
    applied = [f.id for f in pack_registry.all_fixes().values() if pack_registry.status(f).state is State.NEEDED
               and set(f.targets) & set(MODEL_TARGETS)]
    for node_id, target in (("MiniMaxHotfixApplyModel", "model"), ("MiniMaxHotfixApplyCLIP", "clip")):
        stock = backend.patcher(tiny_model()) if target == "model" else ClipStandIn(backend.patcher(tiny_model()))
        keeps_random_state([f for f in applied if target in pack_registry.all_fixes()[f].targets],
                           f"the real {node_id} node",
                           lambda node_id=node_id, target=target, stock=stock:
                           NODE_CLASS_MAPPINGS[node_id]().apply(**{target: stock}))


class ClipStandIn:
    """The slice of comfy.sd.CLIP the Apply node uses: a patcher, and clone() with a cloned patcher."""

    def __init__(self, patcher):
        self.patcher = patcher

    def clone(self):
        return ClipStandIn(self.patcher.clone())


# -- red controls: the check catches a fix that draws --------------------------------------------------------------

def drawing(function, draw):
    def drawn(*args, **kwargs):
        draw()
        return function(*args, **kwargs)

    return drawn


@pytest.mark.parametrize("draw", [lambda: torch.rand(1), lambda: random.random(), lambda: np.random.rand()],
                         ids=["torch", "random", "numpy"])
def test_red_a_detect_that_draws_is_caught(draw, monkeypatch):
    fix = ck_rope_device.FIX
    monkeypatch.setattr(fix, "detect", drawing(fix.detect, draw))
    with pytest.raises(AssertionError, match="changed the global random state"):
        keeps_random_state([], "red control", lambda: pack_registry.status(fix))


def test_red_an_attach_that_draws_is_caught(monkeypatch):
    fix = CountingFix()
    monkeypatch.setattr(fix, "hook_loaded_model", drawing(fix.hook_loaded_model, lambda: torch.rand(1)))
    backend = StandInBackend()
    patcher = backend.patcher(tiny_model())
    with pytest.raises(AssertionError, match="torch \\(CPU\\)"):
        keeps_random_state([], "red control", lambda: attach_run_detach(
            backend, patcher, [fix], lambda: patcher.model(torch.ones(1, 4))))


def test_red_a_first_use_probe_on_the_global_generator_is_caught(monkeypatch):
    """The static-cache probe as it was: its tiny Qwen3 built on the CPU with weights from the global generator."""
    import transformers

    from minimax_hotfix.kernels import transformers_static_cache as static_cache_kernels

    shim = transformers_static_cache
    config = static_cache_kernels.probe_model().config
    monkeypatch.setattr(static_cache_kernels, "probe_model", lambda: transformers.Qwen3ForCausalLM(config).eval())
    monkeypatch.setattr(shim.FIX, "_verdict", None)
    with pytest.raises(AssertionError, match="torch \\(CPU\\)"):
        keeps_random_state([], "red control", shim.FIX.verdict)
