"""Every fix on the simulated newer cores (tests/simulated_cores.py), each core in its own Python process.

For each core: the status every fix reports there (the matrix below, per model kind for int8), and the tests of the fixes that concern that
core, run with COMFYUI_PATH at the core (their red/green tests must pass there, not skip). Then, as CI runs it, each
fix's green test on its core with that fix switched off by MINIMAX_HOTFIX_DISABLE: it must fail with the bug.

Runs in the "with ComfyUI" run (tools/test.sh): the processes need ComfyUI's requirements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import simulated_cores
from nested_pytest import pytest_command

ROOT = Path(__file__).resolve().parents[1]

NEEDED, FIXED, NOT_APPLICABLE, NOT_AFFECTED = "needed", "fixed upstream", "not applicable", "not affected"
# what every fix must report on 0.33.0, and where a newer core differs from it
ON_0_33_0 = {"ck_rope_device": NEEDED, "cpu_device_cuda_query": NEEDED, "transformers_qwen3vl_pos_embed": NEEDED,
             "transformers_static_cache": FIXED, "music3_graph_capture": NEEDED, "qwen3vl_pos_embed": NEEDED,
             "qwen3vl_rotary_table": NEEDED, "int8_full_precision_mm": NEEDED, "music3_graph_buffers": NOT_AFFECTED,
             "vae_qk_norm_scale": NOT_APPLICABLE}
STATUS = {
    "0.33.0": ON_0_33_0,
    "0.36/0.37 VAE": {**ON_0_33_0, "vae_qk_norm_scale": NEEDED},
    "fixed VAE": {**ON_0_33_0, "vae_qk_norm_scale": FIXED},
    "post-#15861 Music 3": {**ON_0_33_0, "music3_graph_buffers": NEEDED},
    # the video VAE and the Music 3 text encoder still need it there (the status reason lists each kind)
    "fixed int8": ON_0_33_0,
    "0.38 Qwen3-VL": ON_0_33_0,
    "fixed Music 3": {**ON_0_33_0, "music3_graph_buffers": FIXED},
    # int8: fixed upstream for diffusion models and sd1_clip text encoders only (INT8_KINDS)
    "0.39 era": {**ON_0_33_0, "music3_graph_buffers": FIXED, "vae_qk_norm_scale": FIXED},
}
# int8_full_precision_mm per model kind (kernels/int8_full_precision_mm.py MODEL_KINDS): "needs it" / FIXED
INT8_ON_0_33_0 = {"diffusion model": "needs it", "text encoder": "needs it", "Music 3 text encoder": "needs it",
                  "MiniMax H3 video VAE": "needs it"}
INT8_FIXED_FOR_DIFFUSION_AND_SD1_CLIP = {**INT8_ON_0_33_0, "diffusion model": FIXED, "text encoder": FIXED}
INT8_KINDS = {name: INT8_ON_0_33_0 for name in STATUS} | {"fixed int8": INT8_FIXED_FOR_DIFFUSION_AND_SD1_CLIP,
                                                         "0.39 era": INT8_FIXED_FOR_DIFFUSION_AND_SD1_CLIP}

VAE_TESTS = "tests/test_vae_qk_norm_scale.py"
MUSIC3_TESTS = "tests/test_music3_graphs_comfyui.py"
QWEN3VL_TESTS = "tests/test_qwen3vl_pos_embed_comfyui.py"
INT8_VAE_TESTS = "tests/test_int8_vae.py"
ROTARY_TESTS = "tests/test_qwen3vl_rotary_table_comfyui.py"
AUDIT_TESTS = "tests/test_placement_audit.py"
CPU_QUERY_TESTS = "tests/test_cpu_device_cuda_query.py"
# cpu_device_cuda_query where CLIP.generate's quantization queries exist (its ops.py): the Music 3 path, and
# use_quantized_matmul called as the 0.39 era's sd.py calls it (that sd.py is not overlaid)
CPU_QUERY_MUST_PASS = ["test_red_music3_text_encode_with_the_fix_off",
                       "test_green_music3_text_encode_equals_an_all_cpu_run",
                       "test_use_quantized_matmul_of_newer_cores_red_then_green"]
MUSIC3_MUST_PASS = [
    "test_detection_follows_the_code_of_this_checkout",
    "test_noise_without_the_pack_where_the_core_has_the_bug",
    "test_with_the_pack_graphs_on_equal_graphs_off",
    "test_buffers_fix_passes_one_stable_buffer_pair_through_the_real_forward",
    "test_gguf_q4_0_unit_red_without_the_pack",
    "test_gguf_q4_0_unit_green_with_the_pack_other_units_keep_graphs",
]
AUDIT_MUST_PASS = ["test_pack_off_finds_the_known_members", "test_pack_on_leaves_no_cross_device_op_and_no_host_work"]

# the test files of the fixes each core concerns, and the tests among them that must pass there (not skip)
CORE_TESTS = {
    "0.36/0.37 VAE": ([VAE_TESTS, AUDIT_TESTS], [
        "test_detection_on_the_running_comfyui",
        "test_partially_loaded_decoder_fails_without_the_fix_and_decodes_with_it",
        "test_fully_resident_decode_is_bitwise_unchanged",
        "test_install_hooks_the_decoder_of_the_real_vae",
        *AUDIT_MUST_PASS]),
    "fixed VAE": ([VAE_TESTS, AUDIT_TESTS], [
        "test_detection_on_the_running_comfyui",
        "test_partially_loaded_decoder_decodes_without_the_pack_where_upstream_fixed_it",
        *AUDIT_MUST_PASS]),
    "post-#15861 Music 3": ([MUSIC3_TESTS, AUDIT_TESTS], [
        *MUSIC3_MUST_PASS,
        *AUDIT_MUST_PASS]),
    "fixed int8": ([INT8_VAE_TESTS, AUDIT_TESTS], [
        "test_int8_vae_red_then_green_through_the_pack_vae_loader_and_apply_node",
        "test_nothing_is_attached_where_the_core_dequantizes_the_layers_itself",
        "test_status_per_model_kind_follows_the_running_core",
        *AUDIT_MUST_PASS]),
    "0.38 Qwen3-VL": ([QWEN3VL_TESTS, ROTARY_TESTS, AUDIT_TESTS], [
        "test_detect_applies_on_this_comfyui",
        "test_offloaded_pos_embed_no_crash_but_gather_on_cpu_then_on_compute_device",
        "test_attaches_through_the_model_patcher_and_survives_clone",
        "test_kernel_equals_comfyui_method_bit_for_bit[dtype0]",
        "test_partial_load_through_the_model_patcher[green: with the fix]",
        *AUDIT_MUST_PASS]),
    "fixed Music 3": ([MUSIC3_TESTS, AUDIT_TESTS], [
        # where #16428 fixed it: without the pack graphs on equal graphs off, and the buffers are the core's own
        *MUSIC3_MUST_PASS,
        *AUDIT_MUST_PASS]),
    # int8: not the VAE's red/green test. There the stock int8 VAE decodes on a CPU in float32 (upstream's cast
    # dequantizes a weight whose dtype differs from the compute dtype), and at the layers' own dtype this ops.py
    # calls comfy-kitchen's int8_linear(..., input_act_weight=), which the comfy-kitchen 0.33.0 pins lacks
    # (TypeError before any torch._int_mm): neither shows the MPS error. Its status per kind is asserted
    # (INT8_KINDS) and so is its use of _full_precision_mm.
    "0.39 era": ([VAE_TESTS, f"{INT8_VAE_TESTS}::test_nothing_is_attached_where_the_core_dequantizes_the_layers_itself",
                  f"{INT8_VAE_TESTS}::test_status_per_model_kind_follows_the_running_core", QWEN3VL_TESTS,
                  ROTARY_TESTS, MUSIC3_TESTS, AUDIT_TESTS,
                  *(f"{CPU_QUERY_TESTS}::{test}" for test in CPU_QUERY_MUST_PASS)], [
        "test_detection_on_the_running_comfyui",
        "test_partially_loaded_decoder_decodes_without_the_pack_where_upstream_fixed_it",
        "test_nothing_is_attached_where_the_core_dequantizes_the_layers_itself",
        "test_status_per_model_kind_follows_the_running_core",
        "test_detect_applies_on_this_comfyui",
        "test_offloaded_pos_embed_no_crash_but_gather_on_cpu_then_on_compute_device",
        "test_attaches_through_the_model_patcher_and_survives_clone",
        "test_partial_load_through_the_model_patcher[green: with the fix]",
        *MUSIC3_MUST_PASS,
        *AUDIT_MUST_PASS,
        *CPU_QUERY_MUST_PASS]),
}

# (core, fix id, its green test, what the failure shows with the fix switched off)
SWITCHED_OFF = [
    ("0.36/0.37 VAE", "vae_qk_norm_scale",
     f"{VAE_TESTS}::test_partially_loaded_decoder_fails_without_the_fix_and_decodes_with_it",
     "Tensor on device cpu is not on the expected device meta"),  # meta's text for the GPU's device mismatch
    ("post-#15861 Music 3", "music3_graph_buffers",
     f"{MUSIC3_TESTS}::test_with_the_pack_graphs_on_equal_graphs_off", "assert False"),
    ("post-#15861 Music 3", "music3_graph_capture",
     f"{MUSIC3_TESTS}::test_gguf_q4_0_unit_green_with_the_pack_other_units_keep_graphs",
     "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"),
    ("fixed int8", "int8_full_precision_mm",
     f"{INT8_VAE_TESTS}::test_int8_vae_red_then_green_through_the_pack_vae_loader_and_apply_node",
     "The operator 'aten::_int_mm' is not currently implemented for the MPS device"),
    ("0.38 Qwen3-VL", "qwen3vl_rotary_table",
     f"{ROTARY_TESTS}::test_partial_load_through_the_model_patcher[green: with the fix]", "{'cpu'} == {'meta'}"),
    ("0.38 Qwen3-VL", "qwen3vl_pos_embed",
     f"{QWEN3VL_TESTS}::test_attaches_through_the_model_patcher_and_survives_clone", "'cpu'"),
    ("fixed Music 3", "music3_graph_capture",
     f"{MUSIC3_TESTS}::test_gguf_q4_0_unit_green_with_the_pack_other_units_keep_graphs",
     "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"),
    ("0.39 era", "music3_graph_capture",
     f"{MUSIC3_TESTS}::test_gguf_q4_0_unit_green_with_the_pack_other_units_keep_graphs",
     "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"),
    ("0.39 era", "qwen3vl_rotary_table",
     f"{ROTARY_TESTS}::test_partial_load_through_the_model_patcher[green: with the fix]", "{'cpu'} == {'meta'}"),
    ("0.39 era", "qwen3vl_pos_embed",
     f"{QWEN3VL_TESTS}::test_attaches_through_the_model_patcher_and_survives_clone", "'cpu'"),
    ("0.39 era", "cpu_device_cuda_query", f"{CPU_QUERY_TESTS}::test_use_quantized_matmul_of_newer_cores_red_then_green",
     "ValueError: Expected a cuda device, but got: cpu"),
]

pytestmark = pytest.mark.skipif(not simulated_cores.available(),
                                reason=f"simulated cores are built from {simulated_cores.BASE}, absent here")


@pytest.fixture(scope="session")
def core_path(comfyui, tmp_path_factory):
    """``core_path(name)``: the path of a simulated core, built once per session."""
    built: dict[str, Path] = {}

    def path(name: str) -> Path:
        if name not in built:
            built[name] = simulated_cores.build_core(name, tmp_path_factory.mktemp("core") / "ComfyUI")
        return built[name]

    return path


def run_in_core(core: Path, name: str, args: list[str], **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "COMFYUI_PATH": str(core), simulated_cores.SIMULATED_CORE_ENV: name, **env}
    environment.pop("PYTEST_CURRENT_TEST", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=900)


def pytest_in_core(core: Path, name: str, targets: list[str], tmp_path: Path, **env):
    """Runs pytest on ``targets`` inside the core; returns (completed process, {test name: outcome})."""
    report = tmp_path / "report.xml"
    done = run_in_core(core, name, pytest_command(*targets, "-rs", f"--junitxml={report}")[1:], **env)
    outcomes = {}
    if report.exists():
        for case in ElementTree.parse(report).iter("testcase"):
            kinds = {child.tag for child in case}
            outcomes[case.get("name")] = ("failed" if kinds & {"failure", "error"} else
                                          "skipped" if "skipped" in kinds else "passed")
    return done, outcomes


STATUS_SCRIPT = """
import json, sys
sys.path.insert(0, {tools!r})
from doctor import load_pack
load_pack()
from minimax_hotfix.diagnostics.comfyui_checkout import use_comfyui_checkout
use_comfyui_checkout()
from minimax_hotfix import registry as pack_registry
print(json.dumps({{fix_id: pack_registry.status(fix).state.value for fix_id, fix in pack_registry.all_fixes().items()}}))
from minimax_hotfix.kernels.int8_full_precision_mm import MODEL_KINDS
from minimax_hotfix.patches.int8_full_precision_mm import FIX as INT8
import comfy.ops
reaching = INT8.kinds_reaching_int_mm(comfy.ops)
print(json.dumps({{kind.name: "needs it" if reaching[kind.name] else "fixed upstream" for kind in MODEL_KINDS}}))
"""


@pytest.mark.parametrize("name", list(STATUS))
def test_every_fix_reports_its_status_on_the_core(name, core_path):
    done = run_in_core(core_path(name), name, ["-c", STATUS_SCRIPT.format(tools=str(ROOT / "tools"))],
                       MINIMAX_HOTFIX_DISABLE="")
    assert done.returncode == 0, done.stderr[-3000:]
    statuses, int8_kinds = map(json.loads, done.stdout.strip().splitlines()[-2:])
    assert statuses == STATUS[name]
    assert int8_kinds == INT8_KINDS[name]


@pytest.mark.parametrize("name", list(CORE_TESTS))
def test_fix_tests_pass_on_the_core_they_concern(name, core_path, tmp_path):
    targets, must_pass = CORE_TESTS[name]
    done, outcomes = pytest_in_core(core_path(name), name, targets, tmp_path, MINIMAX_HOTFIX_DISABLE="")
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert {test: outcomes.get(test) for test in must_pass} == {test: "passed" for test in must_pass}


@pytest.mark.parametrize("name, fix_id, green_test, failure", SWITCHED_OFF,
                         ids=[f"{row[1]} on {row[0]}" for row in SWITCHED_OFF])
def test_green_test_fails_with_its_fix_switched_off(name, fix_id, green_test, failure, core_path, tmp_path):
    done, outcomes = pytest_in_core(core_path(name), name, [green_test], tmp_path, MINIMAX_HOTFIX_DISABLE=fix_id)
    print(f"{fix_id} switched off on {name!r}: {outcomes}")
    assert done.returncode == 1 and list(outcomes.values()) == ["failed"], done.stdout[-3000:]
    assert failure in done.stdout, done.stdout[-3000:]


def test_the_status_matrix_names_every_fix_on_every_core():
    """Runs without ComfyUI: a fix added to patches/ (or retired) without its row here is named per core."""
    from minimax_hotfix import registry as pack_registry

    fixes = set(pack_registry.fix_module_names())
    assert {core: sorted(fixes ^ set(states)) for core, states in STATUS.items() if fixes ^ set(states)} == {}
