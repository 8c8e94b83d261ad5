"""Both Music 3 CUDA-graph fixes on a real ComfyUI (COMFYUI_PATH; skipped without it), on CPU.

A tiny MiniMax Music 3 text encoder (the real ``MiniMaxMusic3TEModel`` tree, 2 Llama layers) runs the real AR loop
(``MiniMaxMusic3AR.generate``) with the real ``Llama2_.forward``. Two CPU stand-ins make the graphed path run:

* ``comfy_kitchen.flash_attention_decode`` (CUDA-only) is replaced by an eager reference, so ``Llama2_`` builds
  ``FixedKV`` caches and takes its graphed-decode branch as on a GPU;
* ``comfy.model_prefetch.prefetch_queue_pop`` is replaced by a per-unit graph emulation with the same gate (the
  unit's ``_v_block``) and the same warm-up / capture / replay sequence, whose replay re-runs the capture step's
  ``core`` with its variables frozen, i.e. reads the tensors (addresses) bound at capture, as a CUDA graph does.
  Capture runs under the emulated capture rules, where a tensor made from Python data is the host copy it is on a GPU.

Units get the ``_v_block`` that ``ModelPatcherDynamic.load`` would give them on a CUDA machine. The fixes are
attached the way the pack's CLIP loader and "Apply MiniMax Hotfix (CLIP)" node attach them.
"""

import gc
import inspect
import types

import pytest
import torch

from hotfix_testing.comfy_memory import unload_all_models
from hotfix_testing.music3_support import (
    FRAMES,
    GGUF_LAYER,
    TINY_MUSIC3_CONFIG,
    emulated_graphs,
    generate,
    gguf_q4_0_down_proj,
    music3_text_encoder,
)
from minimax_hotfix import registry as pack_registry
from minimax_hotfix.contract import State
from minimax_hotfix.diagnostics.emulated_capture import CAPTURE_HOST_COPY_ERROR
from minimax_hotfix.patches.music3_graph_buffers import FIX as BUFFERS
from minimax_hotfix.patches.music3_graph_capture import FIX as CAPTURE
from minimax_hotfix.patches.music3_graph_capture import graph_units


@pytest.fixture(scope="module")
def comfy(comfyui):
    import comfy.ldm.minimax_music.ar as ar
    import comfy.model_management as model_management
    import comfy.model_patcher as model_patcher
    import comfy.model_prefetch as prefetch
    import comfy.text_encoders.llama as llama
    import comfy.text_encoders.minimax_music as music

    return types.SimpleNamespace(ar=ar, model_management=model_management, model_patcher=model_patcher,
                                 prefetch=prefetch, llama=llama, music=music)


@pytest.fixture
def graphs(comfy):
    for fix in (BUFFERS, CAPTURE):
        pack_registry.status(fix)  # detect on the real code, once per process as inside ComfyUI, before the stand-ins
    with emulated_graphs(comfy.prefetch) as emulation:
        yield emulation
    unload_all_models()
    gc.collect()  # a failed generate's traceback keeps its encoder referenced until collected


def loaded(comfy, encoder, with_pack):
    """The encoder's patcher, loaded. Keep it referenced: a collected ModelPatcher detaches (ejects) itself, as the
    CLIP object that owns it in ComfyUI never lets happen mid-run."""
    patcher = comfy.model_patcher.ModelPatcher(encoder, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    if with_pack:
        attached = pack_registry.attach_fixes(patcher, "clip")  # honours MINIMAX_HOTFIX_DISABLE, as the loaders do
        assert [fix.id in attached for fix in (BUFFERS, CAPTURE)] == [
            pack_registry.status(fix).state is State.NEEDED for fix in (BUFFERS, CAPTURE)]
    comfy.model_management.load_models_gpu([patcher], force_full_load=True)
    return patcher


def has_cross_step_buffers(comfy) -> bool:
    return "_comfy_cross_step_state" in inspect.getsource(comfy.llama.Llama2_.forward)


@pytest.mark.cores("post-#15861 Music 3", "fixed Music 3", "0.39 era")
def test_detection_follows_the_code_of_this_checkout(comfy):
    expected = State.NOT_AFFECTED if has_cross_step_buffers(comfy) else (
        State.FIXED_UPSTREAM if "decode_buffers" in inspect.getsource(comfy.ar.MiniMaxMusic3AR.generate)
        else State.NEEDED)
    assert BUFFERS.detect().state is expected, BUFFERS.detect()
    assert CAPTURE.detect().state is State.NEEDED, CAPTURE.detect()


@pytest.mark.cores("post-#15861 Music 3", "fixed Music 3", "0.39 era")
def test_noise_without_the_pack_where_the_core_has_the_bug(comfy, graphs):
    encoder = music3_text_encoder(comfy.music)
    patcher = loaded(comfy, encoder, with_pack=False)  # noqa: F841 (see loaded())
    graphs_off = generate(encoder, graphs, enabled=False)
    graphs_on = generate(encoder, graphs, enabled=True)
    assert len(graphs.graphs) == 1 + TINY_MUSIC3_CONFIG["num_hidden_layers"]
    if BUFFERS.detect().state is State.NEEDED:
        assert (graphs_on - graphs_off).abs().max() > 0.1  # red: stale replay addresses
    else:
        assert torch.equal(graphs_on, graphs_off)  # this core keeps static buffers itself


@pytest.mark.fails_switched_off("music3_graph_buffers", 'assert False', cores=("post-#15861 Music 3",))
@pytest.mark.cores("fixed Music 3", "0.39 era")
def test_with_the_pack_graphs_on_equal_graphs_off(comfy, graphs):
    encoder = music3_text_encoder(comfy.music)
    patcher = loaded(comfy, encoder, with_pack=True)  # noqa: F841 (see loaded())
    graphs_off = generate(encoder, graphs, enabled=False)
    graphs_on = generate(encoder, graphs, enabled=True)
    assert len(graphs.graphs) == 1 + TINY_MUSIC3_CONFIG["num_hidden_layers"]  # every unit kept its graph
    assert torch.equal(graphs_on, graphs_off)


@pytest.mark.cores("post-#15861 Music 3", "fixed Music 3", "0.39 era")
def test_buffers_fix_passes_one_stable_buffer_pair_through_the_real_forward(comfy, graphs, monkeypatch):
    """Where the fix applies, the pack's buffers; where upstream fixed it (#16428), the core's own, with the pack
    attaching nothing (``loaded`` asserts which fixes attach): either way one stable pair for every decode step."""
    state = BUFFERS.detect().state
    if state not in (State.NEEDED, State.FIXED_UPSTREAM):
        pytest.skip(f"music3_graph_buffers is {state.value} on this core")
    seen = []
    original = comfy.llama.Llama2_.forward

    def spy(self, *args, decode_buffers=None, **kwargs):
        seen.append(decode_buffers)
        return original(self, *args, decode_buffers=decode_buffers, **kwargs)

    monkeypatch.setattr(comfy.llama.Llama2_, "forward", spy)
    encoder = music3_text_encoder(comfy.music)
    patcher = loaded(comfy, encoder, with_pack=True)  # noqa: F841 (see loaded())
    assert ("forward" in vars(encoder.model)) is (state is State.NEEDED)  # the pack's override, only where needed
    generate(encoder, graphs, enabled=True)
    prefill, decode_steps = seen[0], seen[1:]
    assert prefill is None and len(decode_steps) >= FRAMES and all(buffers is not None for buffers in decode_steps)
    assert len({buffers[0].data_ptr() for buffers in decode_steps}) == 1


@pytest.mark.cores("post-#15861 Music 3", "fixed Music 3", "0.39 era")
def test_gguf_q4_0_unit_red_without_the_pack(comfy, graphs, tmp_path):
    encoder = music3_text_encoder(comfy.music, gguf_q4_0_down_proj(tmp_path))
    patcher = loaded(comfy, encoder, with_pack=False)  # noqa: F841 (see loaded())
    generate(encoder, graphs, enabled=False)  # runs: the weight itself is fine outside capture
    with pytest.raises(RuntimeError) as failure:
        generate(encoder, graphs, enabled=True)
    assert str(failure.value) == CAPTURE_HOST_COPY_ERROR


@pytest.mark.fails_switched_off("music3_graph_capture", 'Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned', cores=("post-#15861 Music 3", "fixed Music 3", "0.39 era",))
def test_gguf_q4_0_unit_green_with_the_pack_other_units_keep_graphs(comfy, graphs, tmp_path):
    encoder = music3_text_encoder(comfy.music, gguf_q4_0_down_proj(tmp_path))
    layers = encoder.model.layers
    patcher = loaded(comfy, encoder, with_pack=True)  # noqa: F841 (see loaded())
    graphs_off = generate(encoder, graphs, enabled=False)
    graphs_on = generate(encoder, graphs, enabled=True)  # the capture error of the red test, without the fix
    assert layers[GGUF_LAYER]._v_block is None
    assert all(roots[0]._v_block is not None for roots in graph_units(encoder) if roots[0] is not layers[GGUF_LAYER])
    assert set(graphs.graphs) == {encoder.model.audio_decoder, *(l for i, l in enumerate(layers) if i != GGUF_LAYER)}
    assert torch.equal(graphs_on, graphs_off)
    unload_all_models()
    assert layers[GGUF_LAYER]._v_block == ("vbar block",)  # ejecting restores what the load set
