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
from hotfix_testing.music3_support import TINY_MUSIC3_CONFIG, ggml_layout_tensor, write_and_read_gguf
from minimax_hotfix import registry as pack_registry
from minimax_hotfix.contract import State
from minimax_hotfix.diagnostics.emulated_capture import CAPTURE_HOST_COPY_ERROR, emulated_capture
from minimax_hotfix.patches.music3_graph_buffers import FIX as BUFFERS
from minimax_hotfix.patches.music3_graph_capture import FIX as CAPTURE
from minimax_hotfix.patches.music3_graph_capture import graph_units

PROMPT = [[151669, 100, 200, 300, 151670, 151671, 151672]]
FRAMES = 6
GGUF_LAYER = 1


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


def eager_flash_attention_decode(q, k, v, kv_lengths):
    """What comfy-kitchen's CUDA decode kernel computes: q (b, 1, hq, d) over the first kv_lengths cache slots."""
    groups = q.shape[2] // k.shape[2]
    filled = torch.arange(k.shape[1])[None, :] < kv_lengths[:, None]
    # slots past kv_lengths are never read (the cache is torch.empty): zero them instead of multiplying garbage by 0
    k, v = (t.masked_fill(~filled[:, :, None, None], 0).repeat_interleave(groups, dim=2).float() for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~filled[:, None, None, :], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).to(q.dtype)


class EmulatedPrefetch:
    """``prefetch_queue_pop`` for CPU: same gate and warm-up / capture / replay as the real one (no queues on CPU)."""

    def __init__(self):
        self.enabled = True  # False: as with --disable-cuda-graphs
        self.graphs = {}
        self.warmed = set()

    def __call__(self, queue, device, module, dtype=None, core=None, enable_graph=False, generator=None, **_):
        if core is None:
            return
        if not (self.enabled and enable_graph and getattr(module, "_v_block", None) is not None):
            core()
        elif module in self.graphs:
            self.graphs[module]()
        elif module in self.warmed:
            # A graph keeps the addresses core() touched now; a closure called later would see the forward's loop
            # variables as they are then, so the capture keeps core() with its variables frozen at this step.
            frozen = types.FunctionType(core.__code__, core.__globals__, core.__name__, core.__defaults__,
                                        tuple(types.CellType(cell.cell_contents) for cell in core.__closure__))
            with emulated_capture(host_data_is_copy=True):
                frozen()
            self.graphs[module] = frozen
        else:
            core()
            self.warmed.add(module)


@pytest.fixture
def graphs(comfy, monkeypatch):
    import comfy_kitchen

    for fix in (BUFFERS, CAPTURE):
        pack_registry.status(fix)  # detect on the real code, once per process as inside ComfyUI, before the stand-ins
    monkeypatch.setattr(comfy_kitchen, "flash_attention_decode_is_available", lambda device: True)
    monkeypatch.setattr(comfy_kitchen, "flash_attention_decode", eager_flash_attention_decode)
    emulation = EmulatedPrefetch()
    monkeypatch.setattr(comfy.prefetch, "prefetch_queue_pop", emulation)
    if hasattr(comfy.prefetch, "malloc_graph_enabled"):
        # a core with the Comfy Compiler's graph-scoped allocation (#16428's AR loop passes its decode buffers only
        # when it is on): on for as long as the emulated graphs are, as on a CUDA machine with comfy-aimdo
        monkeypatch.setattr(comfy.prefetch, "malloc_graph_enabled", lambda device: emulation.enabled)
    yield emulation
    unload_all_models()
    gc.collect()  # a failed generate's traceback keeps its encoder referenced until collected


def music3_text_encoder(comfy, q4_0_weight=None):
    """A tiny real Music 3 text encoder with seeded weights and the dynamic-VRAM unit marks; with ``q4_0_weight``,
    layer GGUF_LAYER's MLP down_proj holds that GGUF weight."""
    torch.manual_seed(0)
    encoder = comfy.music.MiniMaxMusic3TEModel(device="cpu", model_options={}, projection_config=TINY_MUSIC3_CONFIG)
    with torch.no_grad():
        for parameter in encoder.parameters():
            values = torch.randn(parameter.shape)
            parameter.copy_(values * 0.05 if parameter.ndim > 1 else 1 + values * 0.1)
    if q4_0_weight is not None:
        encoder.model.layers[GGUF_LAYER].mlp.down_proj.weight = torch.nn.Parameter(q4_0_weight, requires_grad=False)
    for roots in graph_units(encoder):
        roots[0]._v_block = ("vbar block",)
    return encoder


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


def generate(encoder, graphs, enabled):
    graphs.enabled = enabled
    graphs.graphs.clear()
    graphs.warmed.clear()
    with torch.no_grad():
        return encoder.generate(torch.tensor(PROMPT), seed=3, max_audio_frames=FRAMES, device=torch.device("cpu"))


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
    encoder = music3_text_encoder(comfy)
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
    encoder = music3_text_encoder(comfy)
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
    encoder = music3_text_encoder(comfy)
    patcher = loaded(comfy, encoder, with_pack=True)  # noqa: F841 (see loaded())
    assert ("forward" in vars(encoder.model)) is (state is State.NEEDED)  # the pack's override, only where needed
    generate(encoder, graphs, enabled=True)
    prefill, decode_steps = seen[0], seen[1:]
    assert prefill is None and len(decode_steps) >= FRAMES and all(buffers is not None for buffers in decode_steps)
    assert len({buffers[0].data_ptr() for buffers in decode_steps}) == 1


def gguf_q4_0_down_proj(tmp_path):
    import gguf

    torch.manual_seed(1)
    weight = torch.randn(TINY_MUSIC3_CONFIG["hidden_size"], TINY_MUSIC3_CONFIG["intermediate_size"]) * 0.05
    raw, shape, _ = write_and_read_gguf(tmp_path / "down.gguf", {"w": weight}, gguf.GGMLQuantizationType.Q4_0)["w"]
    return ggml_layout_tensor(raw, shape, gguf.GGMLQuantizationType.Q4_0)


@pytest.mark.cores("post-#15861 Music 3", "fixed Music 3", "0.39 era")
def test_gguf_q4_0_unit_red_without_the_pack(comfy, graphs, tmp_path):
    encoder = music3_text_encoder(comfy, gguf_q4_0_down_proj(tmp_path))
    patcher = loaded(comfy, encoder, with_pack=False)  # noqa: F841 (see loaded())
    generate(encoder, graphs, enabled=False)  # runs: the weight itself is fine outside capture
    with pytest.raises(RuntimeError) as failure:
        generate(encoder, graphs, enabled=True)
    assert str(failure.value) == CAPTURE_HOST_COPY_ERROR


@pytest.mark.fails_switched_off("music3_graph_capture", 'Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned', cores=("post-#15861 Music 3", "fixed Music 3", "0.39 era",))
def test_gguf_q4_0_unit_green_with_the_pack_other_units_keep_graphs(comfy, graphs, tmp_path):
    encoder = music3_text_encoder(comfy, gguf_q4_0_down_proj(tmp_path))
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
