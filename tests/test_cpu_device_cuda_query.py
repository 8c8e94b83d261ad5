"""cpu_device_cuda_query on a real ComfyUI (COMFYUI_PATH; skipped without it), in this process, on an NVIDIA machine
with the text encoder on its CPU, as in Comfy-Org/ComfyUI#15607 (GTX 1660 SUPER).

This machine has no GPU: ``nvidia_machine`` makes what ComfyUI asks answer as on one: ``is_nvidia()`` and
``torch.cuda.is_available()`` true, torch.cuda's device properties the card's for a CUDA device, and any other device
refused by torch's own check (``torch.cuda._utils._get_device_index``, which raises the bug's
``ValueError: Expected a cuda device, but got: cpu``). ComfyUI runs with ``--cpu``, so every model stays on the CPU:
where ComfyUI puts the text encoder on that card (``test_a_gtx_16xx_gets_its_text_encoder_on_the_cpu``).

The Music 3 runs go through the real node (``MiniMaxMusic3TextEncode``) with a tiny Music 3 text encoder loaded by
ComfyUI's own loader from a synthetic state dict (tests/hotfix_testing/synthetic_models.py); the reference is the same encode on this
all-CPU machine without the fix. The fix is installed through the registry, as ComfyUI's start-up installs it, so the
off switch is honoured.
"""

import contextlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from hotfix_testing import child_pythonpath
from minimax_hotfix import registry as pack_registry
from minimax_hotfix.contract import State
from minimax_hotfix.diagnostics import self_test
from minimax_hotfix.diagnostics.self_tests.cpu_device_cuda_query import RED_TEXT
from minimax_hotfix.kernels.cpu_device_cuda_query import asks_cuda_about_the_cpu, guarded, on_machine, unguarded
from minimax_hotfix.patches.cpu_device_cuda_query import FIX

CPU, CUDA0 = torch.device("cpu"), torch.device("cuda", 0)
GTX_1660_SUPER = types.SimpleNamespace(name="NVIDIA GeForce GTX 1660 SUPER", major=7, minor=5,
                                       multi_processor_count=22, total_memory=6 * 2**30)
RTX_5090 = types.SimpleNamespace(name="NVIDIA GeForce RTX 5090", major=12, minor=0, multi_processor_count=170,
                                 total_memory=32 * 2**30)
ENCODE = {"caption": "the a and", "lyrics": "of to in", "seed": 0, "max_duration": 0.2, "cfg_scale": 1.5, "top_k": 5}


@pytest.fixture(scope="module")
def comfy(comfyui):
    import comfy.memory_management
    import comfy.model_management
    import comfy.ops
    import comfy.sd
    import comfy_kitchen
    from comfy_extras import nodes_minimax_music

    return types.SimpleNamespace(mm=comfy.model_management, ops=comfy.ops, sd=comfy.sd, kitchen=comfy_kitchen,
                                 memory=comfy.memory_management, music=nodes_minimax_music)


@pytest.fixture
def nvidia_machine(comfy):
    """``with nvidia_machine(card=GTX_1660_SUPER):`` this machine looks like an NVIDIA one with ``card``;
    ``nvidia_machine.asked`` lists the devices torch.cuda's properties were looked up for."""
    asked = []

    def device_properties(device, card):
        if device is not None:
            torch.cuda._utils._get_device_index(device, optional=True)  # torch's own refusal of a CPU device
        asked.append(device)
        return card

    @contextlib.contextmanager
    def machine(card=GTX_1660_SUPER):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(comfy.mm, "is_nvidia", lambda: True)
            patch.setattr(torch.cuda, "is_available", lambda: True)
            patch.setattr(torch.cuda, "get_device_properties", lambda device=None: device_properties(device, card))
            yield

    machine.asked = asked
    return machine


@pytest.fixture(scope="module")
def music3_clip(comfy):
    """ComfyUI's CLIP of a tiny Music 3 text encoder, loaded where ComfyUI puts it (the CPU here)."""
    from hotfix_testing import synthetic_models

    state = synthetic_models.music3_text_encoder(torch.Generator().manual_seed(0))
    with synthetic_models.tiny_configs():
        return comfy.sd.load_text_encoder_state_dicts([state], clip_type=comfy.sd.CLIPType.MINIMAX)


def encode(comfy, clip):
    """What ComfyUI's executor runs for the Music 3 text encode node: (conditioning tensor, seconds)."""
    with torch.inference_mode():
        conditioning, seconds = comfy.music.MiniMaxMusic3TextEncode.execute(clip, **ENCODE).result
    return conditioning[0][0], seconds


@pytest.fixture(scope="module")
def all_cpu_run(comfy, music3_clip):
    return encode(comfy, music3_clip)


def test_a_gtx_16xx_gets_its_text_encoder_on_the_cpu(comfy, nvidia_machine):
    """The placement behind the bug: ComfyUI's own choice for that card (fp16 is "broken" on GTX 16xx)."""
    with nvidia_machine(GTX_1660_SUPER), pytest.MonkeyPatch.context() as patch:
        patch.setattr(comfy.mm, "cpu_state", comfy.mm.CPUState.GPU)
        patch.setattr(comfy.mm, "vram_state", comfy.mm.VRAMState.NORMAL_VRAM)
        assert comfy.mm.text_encoder_device() == CPU
    assert comfy.mm.text_encoder_device() == CPU  # and on this --cpu ComfyUI, where the tests run it


@pytest.mark.cores("0.39 era")
def test_red_music3_text_encode_with_the_fix_off(comfy, music3_clip, nvidia_machine, registry, monkeypatch):
    if ("comfy_kitchen", "flash_attention_decode_is_available") not in FIX.queries_asking_cuda():
        pytest.skip("this comfy-kitchen answers for a CPU device itself (comfy-kitchen #131)")
    monkeypatch.setenv(pack_registry.DISABLE_ENV, FIX.id)
    registry(FIX)
    assert pack_registry.install_process_fixes() == []
    with nvidia_machine(), pytest.raises(ValueError) as failure:
        encode(comfy, music3_clip)
    assert str(failure.value) == RED_TEXT
    frames = [entry.name for entry in failure.traceback]
    assert frames[frames.index("execute"):] == [
        "execute", "encode_from_tokens_scheduled", "encode_from_tokens", "encode_token_weights", "generate",
        "init_kv_cache", "is_available", "get_device_capability", "<lambda>", "device_properties",
        "_get_device_index"], frames


@pytest.mark.cores("0.39 era")
def test_green_music3_text_encode_equals_an_all_cpu_run(comfy, music3_clip, all_cpu_run, nvidia_machine, registry):
    registry(FIX)
    try:
        installed = pack_registry.install_process_fixes()
        with nvidia_machine():
            conditioning, seconds = encode(comfy, music3_clip)
    finally:
        pack_registry.uninstall_process_fixes()
    reference, reference_seconds = all_cpu_run
    print(f"\nMusic 3 conditioning {tuple(conditioning.shape)}: max abs diff vs the all-CPU run "
          f"{(conditioning - reference).abs().max().item()}")
    assert torch.equal(conditioning, reference) and seconds == reference_seconds
    assert installed == [FIX.id]


def test_quantization_queries_red_then_green_as_an_all_cpu_run(comfy, nvidia_machine, registry):
    """The queries ``get_disabled_quant_formats`` asks on newer cores (``CLIP.generate``'s ``use_quantized_matmul``,
    Comfy-Org/ComfyUI#16365), asked about the CPU: red without the fix, the all-CPU answers with it."""
    names = ["supports_fp8_compute", "supports_nvfp4_compute", "supports_mxfp8_compute"]
    all_cpu = {name: getattr(comfy.mm, name)(CPU) for name in names}
    with nvidia_machine():
        for name in names:
            with pytest.raises(ValueError, match=f"^{RED_TEXT}$"):
                getattr(comfy.mm, name)(CPU)
    registry(FIX)
    try:
        installed = pack_registry.install_process_fixes()
        with nvidia_machine():
            assert {name: getattr(comfy.mm, name)(CPU) for name in names} == all_cpu
    finally:
        pack_registry.uninstall_process_fixes()
    assert installed == [FIX.id]


@pytest.mark.fails_switched_off("cpu_device_cuda_query", "Expected a cuda device, but got: cpu", cores=("0.39 era",))
@pytest.mark.cores("fixed int8")
def test_use_quantized_matmul_of_newer_cores_red_then_green(comfy, nvidia_machine, registry):
    """What ``CLIP.generate`` does on newer cores (033046cc's comfy/sd.py: ``with cuda_device_context(device),
    comfy.ops.use_quantized_matmul(self.cond_stage_model, device)``) for an encoder with an int8 layer on the CPU."""
    if not hasattr(comfy.ops, "use_quantized_matmul"):
        pytest.skip("0.33.0's CLIP.generate asks no quantization query (newer cores do: Comfy-Org/ComfyUI#16365)")
    from minimax_hotfix.kernels.int8_full_precision_mm import tiny_int8_linear

    layer = tiny_int8_linear(comfy.ops, 64, 16)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))

    def generate_step():
        with torch.inference_mode(), comfy.ops.use_quantized_matmul(layer, CPU):
            return layer._full_precision_mm, layer(x)

    all_cpu_flag, all_cpu_out = generate_step()
    with nvidia_machine(), pytest.raises(ValueError, match=f"^{RED_TEXT}$"):
        generate_step()
    registry(FIX)
    try:
        installed = pack_registry.install_process_fixes()
        with nvidia_machine():
            flag, out = generate_step()
    finally:
        pack_registry.uninstall_process_fixes()
    assert flag == all_cpu_flag and torch.equal(out, all_cpu_out) and installed == [FIX.id]


def test_gpu_models_still_ask_the_real_queries(comfy, nvidia_machine, registry):
    """The GPU models of the workflow: a CUDA device (and the current one) reaches each query itself, and a diffusion
    model's operations picked for cuda:0 are those without the fix."""
    names = ("supports_fp8_compute", "supports_nvfp4_compute", "supports_mxfp8_compute")
    quantized = types.SimpleNamespace(quant_config={"int8_tensorwise": {}})
    registry(FIX)
    for card in (GTX_1660_SUPER, RTX_5090):
        with nvidia_machine(card):
            unfixed = comfy.ops.pick_operations(None, torch.bfloat16, load_device=CUDA0, model_config=quantized)
            try:
                assert pack_registry.install_process_fixes() == [FIX.id]
                queries = {name: getattr(comfy.mm, name) for name in names}
                queries["flash_attention_decode_is_available"] = comfy.kitchen.flash_attention_decode_is_available
                for name, query in queries.items():
                    for device in (CUDA0, None):
                        nvidia_machine.asked.clear()
                        assert query(device) == unguarded(query)(device), (card.name, name, device)
                        assert nvidia_machine.asked[:1] == [device], (card.name, name, device)
                picked = comfy.ops.pick_operations(None, torch.bfloat16, load_device=CUDA0, model_config=quantized)
            finally:
                pack_registry.uninstall_process_fixes()
        assert picked._disabled == unfixed._disabled, card.name
    assert picked._disabled == set()  # the RTX 5090 keeps its native NVFP4, MXFP8 and FP8 kernels


def test_detection_on_this_comfyui(comfy, fresh_detection):
    status = pack_registry.status(FIX)
    assert status.state is State.NEEDED, status
    assert "comfy.model_management.supports_nvfp4_compute" in status.reason


def test_queries_that_look_at_the_device_first_read_fixed_upstream(comfy, fresh_detection, monkeypatch):
    for module, name in FIX.queries():
        original = getattr(module_named(comfy, module), name)

        def looks_first(device=None, original=original):
            return False if device is not None and torch.device(device).type != "cuda" else original(device)

        monkeypatch.setattr(module_named(comfy, module), name, looks_first)
    assert pack_registry.status(FIX).state is State.FIXED_UPSTREAM
    assert FIX.queries_asking_cuda() == {}


def module_named(comfy, name):
    return {"comfy_kitchen": comfy.kitchen, "comfy.model_management": comfy.mm}[name]


def test_install_is_idempotent_and_uninstall_restores(comfy):
    originals = {key: getattr(module_named(comfy, key[0]), key[1]) for key in FIX.queries_asking_cuda()}
    FIX.install()
    wrapped = {key: getattr(module_named(comfy, key[0]), key[1]) for key in originals}
    FIX.install()
    try:
        assert all(getattr(module_named(comfy, key[0]), key[1]) is wrapped[key] for key in originals)
        assert all(wrapped[key] is not originals[key] and wrapped[key].__wrapped__ is originals[key]
                   and unguarded(wrapped[key]) is originals[key] for key in originals)
    finally:
        FIX.uninstall()
    assert all(getattr(module_named(comfy, key[0]), key[1]) is originals[key] for key in originals)


def test_self_test_red_then_green(comfy):
    checks = list(self_test(FIX))
    assert checks and checks[0].name.startswith("red:") and all(check.passed for check in checks), checks


def test_not_applicable_without_comfyui():
    from minimax_hotfix.contract.comfy import comfy_module

    if comfy_module("comfy.model_management") is not None:
        pytest.skip("ComfyUI is importable here; the tests above cover it")
    assert FIX.detect().state is State.NOT_APPLICABLE


def is_nvidia():
    """The module of ``supports_nvfp4_compute`` below: this machine, without an NVIDIA GPU."""
    return False


def supports_nvfp4_compute(device=None):
    """0.33.0's ``comfy.model_management.supports_nvfp4_compute``, for the run without ComfyUI."""
    if not is_nvidia():
        return False
    return torch.cuda.get_device_properties(device).major >= 10


def test_machine_views_and_the_wrapper_on_a_query_shaped_as_comfyuis():
    assert asks_cuda_about_the_cpu(supports_nvfp4_compute)
    assert not asks_cuda_about_the_cpu(supports_nvfp4_compute, nvidia=False)
    on_nvidia = on_machine(supports_nvfp4_compute, nvidia=True)
    with pytest.raises(ValueError, match=f"^{RED_TEXT}$"):
        on_nvidia(CPU)
    answered = []
    wrapper = guarded(on_nvidia, lambda *answer: answered.append(answer))
    assert wrapper(CPU) is False and answered == [("supports_nvfp4_compute", CPU, False)]
    assert unguarded(wrapper) is on_nvidia and unguarded(on_nvidia) is on_nvidia


def test_each_first_cpu_answer_is_logged_once_per_install_across_threads(caplog):
    """Red before: an unlocked check-then-add logged a first answer once per racing thread, and an uninstall kept the
    set, so the next install (tests, a reload of the pack) logged nothing."""
    import threading

    fix = type(FIX)()
    barrier = threading.Barrier(8)

    def answer():
        barrier.wait()
        fix._log_first_cpu_answer("supports_nvfp4_compute", CPU, False)

    for _ in range(2):  # install, answer from eight threads at once, uninstall; then again
        caplog.clear()
        with caplog.at_level("INFO", logger="minimax_hotfix"):
            threads = [threading.Thread(target=answer) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        fix.uninstall()
        assert sum("answered supports_nvfp4_compute" in record.getMessage() for record in caplog.records) == 1


KITCHEN_OVERLAY = "comfy-kitchen-0.2.36"  # tools/test.sh builds it beside .venv-comfyui: the first kitchen that looks
# at the device before asking CUDA
ON_THIS_KITCHEN = """
import importlib.metadata, json, os, sys
from comfy.cli_args import args; args.cpu = True
from minimax_hotfix import registry
from minimax_hotfix.patches.cpu_device_cuda_query import FIX
print(json.dumps({"kitchen": importlib.metadata.version("comfy-kitchen"), "state": registry.status(FIX).state.value,
                  "reason": registry.status(FIX).reason,
                  "asking": [f"{module}.{name}" for module, name in FIX.queries_asking_cuda()]}))
"""


def on_kitchen(overlay) -> dict:
    environment = {**os.environ, "PYTHONPATH": child_pythonpath(str(overlay) if overlay else None)}
    # cwd: ComfyUI's folder, which python -c puts first on the path, as "python main.py" run there
    done = subprocess.run([sys.executable, "-c", ON_THIS_KITCHEN], capture_output=True, text=True, env=environment,
                          check=False, timeout=300, cwd=os.environ["COMFYUI_PATH"])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_kitchen_0_2_36_answers_for_the_cpu_itself_and_comfyuis_half_stays_needed(comfy):
    """The kitchen half reads "fixed upstream" on comfy-kitchen 0.2.36 (not wrapped, named so in the reason) while
    ComfyUI's supports_*_compute, which no release note names as fixed, stay needed. Red control: ComfyUI's own
    kitchen (0.2.31) still asks CUDA."""
    overlay = Path(sys.prefix) / "extra" / KITCHEN_OVERLAY
    if not overlay.is_dir():
        pytest.skip(f"needs {overlay}: tools/test.sh builds it with .venv-comfyui")
    pinned, newer = on_kitchen(None), on_kitchen(overlay)
    kitchen_query = "comfy_kitchen.flash_attention_decode_is_available"
    comfyui_queries = {f"comfy.model_management.supports_{kind}_compute" for kind in ("fp8", "nvfp4", "mxfp8")}
    assert pinned["kitchen"] == "0.2.31" and kitchen_query in pinned["asking"]
    assert newer["kitchen"] == "0.2.36" and kitchen_query not in newer["asking"]
    assert set(newer["asking"]) == comfyui_queries and newer["state"] == "needed"
    assert newer["reason"].endswith(f"; fixed upstream: {kitchen_query}"), newer["reason"]
    print(f"\nkitchen {pinned['kitchen']}: asking CUDA {pinned['asking']}\nkitchen {newer['kitchen']}: asking CUDA "
          f"{newer['asking']}; {newer['reason'][-80:]}")
