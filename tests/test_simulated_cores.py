"""The status every fix reports on each simulated core (tests/hotfix_testing/simulated_cores.py), per model kind for int8.

Each core runs in its own Python process, started by ``python tests/hotfix_testing/simulated_cores.py`` (tools/test.sh, run 3),
which selects the tests marked for that core (``cores``, ``fails_switched_off``: tests/conftest.py); this test is
marked for every core in the matrix.
"""

from __future__ import annotations

import pytest

from hotfix_testing import simulated_cores

NEEDED, FIXED, NOT_APPLICABLE, NOT_AFFECTED = "needed", "fixed upstream", "not applicable", "not affected"
# what every fix must report on 0.33.0, and where a newer core differs from it
ON_0_33_0 = {"ck_rope_device": NEEDED, "cpu_device_cuda_query": NEEDED, "transformers_qwen3vl_pos_embed": NEEDED,
             "transformers_static_cache": FIXED, "music3_graph_capture": NEEDED, "qwen3vl_pos_embed": NEEDED,
             "qwen3vl_rotary_table": NEEDED, "int8_full_precision_mm": NEEDED, "music3_graph_buffers": NOT_AFFECTED,
             "vae_qk_norm_scale": NOT_APPLICABLE, "h3_fp16_overflow": NEEDED}
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

pytestmark = pytest.mark.skipif(not simulated_cores.available(),
                                reason=f"simulated cores are built from {simulated_cores.BASE}, absent here")


@pytest.mark.cores(*STATUS)
def test_every_fix_reports_its_status_on_the_core(comfyui, fresh_detection):
    name = simulated_cores.running_on_simulated_core()
    if name is None:
        pytest.skip("runs in each simulated core's own run (python tests/hotfix_testing/simulated_cores.py)")
    import comfy.ops

    from minimax_hotfix import registry as pack_registry
    from minimax_hotfix.kernels.int8_full_precision_mm import MODEL_KINDS
    from minimax_hotfix.patches.int8_full_precision_mm import FIX as INT8

    statuses = {fix_id: pack_registry.status(fix).state.value for fix_id, fix in pack_registry.all_fixes().items()}
    reaching = INT8.kinds_reaching_int_mm(comfy.ops)
    assert statuses == STATUS[name]
    assert {kind.name: "needs it" if reaching[kind.name] else FIXED for kind in MODEL_KINDS} == INT8_KINDS[name]


def test_the_status_matrix_names_every_fix_on_every_core():
    """Runs without ComfyUI: a fix added to patches/ (or retired) without its row here is named per core."""
    from minimax_hotfix import registry as pack_registry

    fixes = set(pack_registry.fix_module_names())
    assert {core: sorted(fixes ^ set(states)) for core, states in STATUS.items() if fixes ^ set(states)} == {}
