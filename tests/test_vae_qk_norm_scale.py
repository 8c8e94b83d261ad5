"""vae_qk_norm_scale: the MiniMax H3 video VAE decodes with its qk_norm_scale left behind by a partial load, with no
host-to-device copy per call after the first, and ComfyUI's buffer bookkeeping only ever sees its own tensors.

Without COMFYUI_PATH the hooks are tested on the self-test's stand-in module (the shape of the VAE's Attention around
the bug) with FakeTensor "cuda" inputs and kitchen's real routing. With COMFYUI_PATH pointing at a ComfyUI whose VAE
has ``qk_norm_scale`` (0.36+, or 0.33.0 with a newer vae.py overlaid), a tiny decoder built from the real classes is
loaded through a real ModelPatcher onto ``meta`` (the stand-in GPU: Python indexing in the decoder rules out FakeTensor
"cuda" there) with a budget that leaves the buffer on the CPU.
"""

import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch

from hotfix_testing.newer_linear_input_act import use_newer_linear_input_act
from minimax_hotfix import registry as pack_registry
from minimax_hotfix.contract import State, remove_handles
from minimax_hotfix.contract.comfy import comfy_module
from minimax_hotfix.diagnostics import self_test
from minimax_hotfix.diagnostics.devices import HostToDeviceCopies
from minimax_hotfix.diagnostics.kitchen import real_kitchen_routing, rope_inputs
from minimax_hotfix.diagnostics.self_tests.vae_qk_norm_scale import UnitScaleRmsRope
from minimax_hotfix.kernels.ck_rope_device import is_device_mismatch
from minimax_hotfix.kernels.fake_cuda import fake_cuda_mode, on_fake_cuda
from minimax_hotfix.kernels.resident_copies import ResidentCopies
from minimax_hotfix.patches import vae_qk_norm_scale

FIX = vae_qk_norm_scale.FIX

pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")


# --- detection of the call site --------------------------------------------------------------------------------------

class RawBuffer(torch.nn.Module):  # the 0.36/0.37 call site
    def forward(self, query, key, table):
        return rms_rope(query, key, table, self.qk_norm_scale, epsilon=1e-5)  # noqa: F821


class CallSiteMove(torch.nn.Module):  # PR #16391
    def forward(self, query, key, table):
        return rms_rope(query, key, table, self.qk_norm_scale.to(query.device), epsilon=1e-5)  # noqa: F821


class SeedWorkaround(torch.nn.Module):  # the workaround verified in #16484
    def forward(self, query, key, table):
        scale = self.qk_norm_scale
        if scale.device != query.device:
            scale = scale.to(query.device)
        return rms_rope(query, key, table, scale)  # noqa: F821


class RawAlias(torch.nn.Module):
    def forward(self, query, key, table):
        scale = self.qk_norm_scale
        return rms_rope(query, key, table, q_scale=scale)  # noqa: F821


@pytest.mark.parametrize("module, raw", [(RawBuffer, True), (CallSiteMove, False), (SeedWorkaround, False),
                                         (RawAlias, True)])
def test_call_site_reading(module, raw):
    assert vae_qk_norm_scale.hands_raw_buffer(module.forward, "qk_norm_scale") is raw


# --- the hooks on the stand-in module ---------------------------------------------------------------------------------

class CallSiteFixed(UnitScaleRmsRope):
    """What upstream PR #16391 does: move the buffer at the call site, on every call."""

    def forward(self, q, k, table):
        import comfy_kitchen

        return comfy_kitchen.rms_rope_split_half(q, k, table, self.qk_norm_scale.to(q.device), rot_dim=32)


def fake_cuda_calls(module, hooked, calls=4):
    """Runs ``module`` ``calls`` times on FakeTensor cuda q/k/table; returns (routes, H2D copies per call, error)."""
    with fake_cuda_mode() as mode, real_kitchen_routing() as chosen:
        q, k, table, _ = rope_inputs(lambda t: on_fake_cuda(mode, t))
        handles = vae_qk_norm_scale.hook_decoders([module]) if hooked else []
        copies = []
        try:
            for _ in range(calls):
                with HostToDeviceCopies() as counted:
                    module(q, k, table)
                copies.append(len(counted))
        except RuntimeError as exc:
            return chosen, copies, exc
        finally:
            for handle in handles:
                handle.remove()
    return chosen, copies, None


def test_red_buffer_left_on_cpu_fails_in_eager():
    chosen, _, error = fake_cuda_calls(UnitScaleRmsRope(64, torch.bfloat16), hooked=False)
    assert chosen == ["eager"] and is_device_mismatch(error)
    assert "Expected all tensors to be on the same device" in str(error)


def test_green_hooked_module_is_routed_to_cuda_and_copies_only_on_the_first_call():
    module = UnitScaleRmsRope(64, torch.bfloat16)
    left_behind = module.qk_norm_scale
    chosen, copies, error = fake_cuda_calls(module, hooked=True)
    assert error is None and chosen == ["cuda"] * 4
    assert copies == [1, 0, 0, 0]
    assert module.qk_norm_scale is left_behind and not module._forward_pre_hooks and not module._forward_hooks


def test_the_upstream_call_site_fix_copies_on_every_call():
    chosen, copies, error = fake_cuda_calls(CallSiteFixed(64, torch.bfloat16), hooked=False)
    assert error is None and chosen == ["cuda"] * 4 and copies == [1, 1, 1, 1]


def scales_seen(module) -> list:
    """The ``qk_norm_scale`` each call of ``module`` hands its kernel (a pre-hook added after the fix's own)."""
    seen = []
    module.register_forward_pre_hook(lambda mod, args: seen.append(mod.qk_norm_scale))
    return seen


def test_on_the_input_device_the_hooks_hand_the_buffer_itself_with_unchanged_values():
    q, k, table, _ = rope_inputs(lambda t: t.float())
    module = UnitScaleRmsRope(64, torch.float32)
    module.qk_norm_scale.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    expected = module(q, k, table)
    handles = vae_qk_norm_scale.hook_decoders([module])
    seen = scales_seen(module)
    with HostToDeviceCopies() as counted:
        got = module(q, k, table)
    for handle in handles:
        handle.remove()
    assert len(seen) == 1 and seen[0] is module.qk_norm_scale and not counted  # the buffer itself, no copy
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_moved_by_the_hooks_the_kernel_gets_what_the_upstream_call_site_fix_gives_it():
    """On FakeTensor cuda q/k (the buffer left on the CPU) the hooks have something to move: the kernel receives the
    buffer on q's device in its own dtype and shape, as with PR #16391's ``.to(q.device)``, and returns the same."""
    results = {}
    for name, module, hooked in (("hooks", UnitScaleRmsRope(64, torch.bfloat16), True),
                                 ("call-site fix", CallSiteFixed(64, torch.bfloat16), False)):
        left_behind = module.qk_norm_scale
        with fake_cuda_mode() as mode, real_kitchen_routing() as chosen:
            q, k, table, _ = rope_inputs(lambda t: on_fake_cuda(mode, t))
            handles = vae_qk_norm_scale.hook_decoders([module]) if hooked else []
            seen = scales_seen(module)
            out = module(q, k, table)
            for handle in handles:
                handle.remove()
            scale = seen[0] if hooked else seen[0].to(q.device)  # the call-site fix moves it inside forward
        results[name] = (chosen, (scale.device, scale.dtype, scale.shape),
                         [(t.device, t.dtype, t.shape) for t in out])
        assert left_behind.device.type == "cpu" and module.qk_norm_scale is left_behind
    assert results["hooks"] == results["call-site fix"]
    assert results["hooks"][1] == (torch.device("cuda:0"), torch.bfloat16, torch.Size([64]))


class Raises(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("qk_norm_scale", torch.ones(4), persistent=False)

    def forward(self, x):
        assert self.qk_norm_scale.device == x.device
        raise RuntimeError("boom")


def test_the_loaders_buffer_is_put_back_when_forward_raises():
    module = Raises()
    left_behind = module.qk_norm_scale
    with fake_cuda_mode() as mode:
        x = on_fake_cuda(mode, torch.zeros(4))
        vae_qk_norm_scale.hook_decoders([module])
        with pytest.raises(RuntimeError, match="boom"):
            module(x)
    assert module.qk_norm_scale is left_behind


class PausesInside(torch.nn.Module):
    """Returns its buffer's device at the start of the call and again after ``pause()``, which the test choreographs."""

    def __init__(self, pause):
        super().__init__()
        self.register_buffer("qk_norm_scale", torch.ones(4), persistent=False)
        self.pause = pause

    def forward(self, x):
        at_start = self.qk_norm_scale.device
        self.pause()
        return at_start, self.qk_norm_scale.device


def buffer_devices_of_overlapping_calls(first_input, second_input):
    """Two threads decode through one hooked module (buffer left on the CPU): the second call starts once the first is
    inside forward, the first stays inside until the second is inside too (or, when the second has to wait for the
    put-back, for 0.5 s), and the second looks at its buffer again only after the first call has returned. Returns
    each call's (buffer device at its start, at its end) or its error, and whether the loader's buffer is back."""
    first_inside, second_inside, first_returned = threading.Event(), threading.Event(), threading.Event()

    def pause():
        if threading.current_thread().name == "first":
            first_inside.set()
            second_inside.wait(0.5)
        else:
            second_inside.set()
            first_returned.wait(5)

    module = PausesInside(pause)
    left_behind = module.qk_norm_scale
    vae_qk_norm_scale.hook_decoders([module])
    seen = {}

    def call(name, x):
        try:
            seen[name] = tuple(str(device) for device in module(x))
        except Exception as exc:  # noqa: BLE001 - a call failing is what the test reports
            seen[name] = f"{type(exc).__name__}: {exc}"
        if name == "first":
            first_returned.set()

    threads = {name: threading.Thread(target=call, args=(name, x), name=name)
               for name, x in (("first", first_input), ("second", second_input))}
    threads["first"].start()
    assert first_inside.wait(5)
    threads["second"].start()
    for thread in threads.values():
        thread.join(10)
    return seen, module.qk_norm_scale is left_behind


def test_two_overlapping_calls_on_one_device_keep_the_buffer_there_until_both_returned():
    seen, put_back = buffer_devices_of_overlapping_calls(torch.zeros(4, device="meta"), torch.zeros(4, device="meta"))
    assert seen == {"first": ("meta", "meta"), "second": ("meta", "meta")} and put_back


def test_a_call_on_another_device_waits_until_the_buffer_is_put_back():
    """One module, two devices at once (its weights cast per call, as ComfyUI's ops do for a partial load): each call
    sees the buffer on its own device throughout."""
    seen, put_back = buffer_devices_of_overlapping_calls(torch.zeros(4, device="meta"), torch.zeros(4))
    assert seen == {"first": ("meta", "meta"), "second": ("cpu", "cpu")} and put_back


def test_a_call_stopped_by_an_earlier_pre_hook_puts_nothing_back():
    """torch runs the always-call post-hook even when a pre-hook registered before the fix's raises; the fix's
    pre-hook never ran then, so that call must not count as one that leaves."""
    module = Raises()
    left_behind = module.qk_norm_scale

    def refuses(mod, args):
        raise ValueError("refused")

    handle = module.register_forward_pre_hook(refuses)
    vae_qk_norm_scale.hook_decoders([module])
    with pytest.raises(ValueError, match="refused"):
        module(torch.zeros(4, device="meta"))
    handle.remove()
    seen = []
    module.forward = lambda x: seen.append(module.qk_norm_scale.device)
    next_call = threading.Thread(target=module, args=(torch.zeros(4, device="meta"),))  # miscounted, it would wait
    next_call.start()
    next_call.join(5)
    assert seen == [torch.device("meta")] and module.qk_norm_scale is left_behind


def test_a_hooked_decoder_is_freed_once_unhooked():
    module = Raises()
    handles = vae_qk_norm_scale.hook_decoders([module])
    module_ref = weakref.ref(module)
    remove_handles(handles)
    del module
    gc.collect()
    assert module_ref() is None


def test_follows_comfyui_moving_and_restoring_the_buffer():
    """Dynamic VRAM moves every buffer to the GPU keeping a backup and may put the backup back later; the legacy loader
    leaves it behind. The hooks use whatever is there and copy a CPU buffer once per tensor version."""
    copies = ResidentCopies()
    seen = []

    class Records(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("qk_norm_scale", torch.ones(4), persistent=False)

        def forward(self, x):
            seen.append(self.qk_norm_scale)
            return x

    module = Records()
    backup = module.qk_norm_scale
    with fake_cuda_mode() as mode:
        x = on_fake_cuda(mode, torch.zeros(4))
        vae_qk_norm_scale.keep_buffers_on_input_device(module, copies)

        def call():
            with HostToDeviceCopies() as counted:
                module(x)
            return len(counted)

        assert call() == 1 and call() == 0  # left behind by a partial load
        loaded_by_comfyui = backup.to(x.device)
        module.qk_norm_scale = loaded_by_comfyui  # ModelPatcherDynamic.load
        assert call() == 0 and seen[-1] is loaded_by_comfyui and module.qk_norm_scale is loaded_by_comfyui
        module.qk_norm_scale = backup  # restore_loaded_backups
        assert call() == 0 and seen[-1] is seen[0]
        backup.mul_(2)  # changed in place: copied again, once
        assert call() == 1 and call() == 0
        module.qk_norm_scale = torch.ones(4)  # replaced: copied again, once
        assert call() == 1 and call() == 0
    assert all(tensor.device == x.device for tensor in seen)


def test_self_test_red_then_green():
    checks = list(self_test(FIX))
    assert checks[0].name.startswith("red:") and all(check.passed for check in checks), checks


def test_not_applicable_without_comfyui(fresh_detection):
    if comfy_module("comfy.ldm.minimax.vae") is not None:
        pytest.skip("ComfyUI is importable in this run; its detection is tested below")
    assert pack_registry.status(FIX).state == State.NOT_APPLICABLE


# --- a real ComfyUI: COMFYUI_PATH ------------------------------------------------------------------------------------

def expected_state_from_source(path: Path) -> State:
    source = path.read_text(encoding="utf-8")
    if "qk_norm_scale" not in source:
        return State.NOT_APPLICABLE
    if "rotary_pos_emb, self.qk_norm_scale," in source:
        return State.NEEDED
    return State.FIXED_UPSTREAM


@pytest.mark.cores("0.36/0.37 VAE", "fixed VAE", "0.39 era")
def test_detection_on_the_running_comfyui(comfyui, fresh_detection):
    expected = expected_state_from_source(Path(comfyui) / "comfy" / "ldm" / "minimax" / "vae.py")
    assert pack_registry.status(FIX).state == expected


@pytest.fixture
def vae(comfyui, monkeypatch):
    """comfy.ldm.minimax.vae of the running ComfyUI, made to run on CPU/meta."""
    import comfy.ldm.modules.attention
    from comfy.ldm.minimax import vae

    if not vae_qk_norm_scale.owns_scale_buffer(vae.Attention):
        pytest.skip("this ComfyUI's Attention has no qk_norm_scale (0.33.0): the stand-in module tests above ran "
                    "instead")
    use_newer_linear_input_act(monkeypatch.setattr)  # 0.33.0 core with a newer vae.py overlaid
    # sub-quadratic attention (CPU default) asks the device's free memory, which meta has not
    monkeypatch.setattr(vae, "optimized_attention", comfy.ldm.modules.attention.attention_pytorch)
    return vae


def tiny_decoder(vae):
    torch.manual_seed(0)
    decoder = vae.ViT3DDecoder(patch_size=2, patch_size_t=1, in_channels=4, out_channels=3, num_layers=2, heads=2,
                               dim_head=32)
    for parameter in decoder.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    return decoder


def decode_h2d(decoder, latent, buffers):
    """Decodes once; returns the host-to-device copies of model buffers it made."""
    with HostToDeviceCopies() as counted:
        decoder(latent)
    return counted.made_from(buffers)


def partially_loaded(vae, with_fix):
    """A tiny decoder loaded onto meta through ModelPatcher with half its size as budget (a partial load)."""
    import comfy.model_management
    from comfy.model_patcher import ModelPatcher

    decoder = tiny_decoder(vae)
    patcher = ModelPatcher(decoder, load_device=torch.device("meta"), offload_device=torch.device("cpu"))
    if with_fix:
        pack_registry.attach_fixes(patcher, "vae")  # as the pack's VAE loader does: honours MINIMAX_HOTFIX_DISABLE
    patcher.patch_model(device_to=torch.device("meta"),
                        lowvram_model_memory=comfy.model_management.module_size(decoder) // 2)
    assert decoder.model_lowvram and {p.device.type for p in decoder.parameters()} == {"meta", "cpu"}
    assert all(b.device.type == "cpu" for _, b in decoder.named_buffers())  # the buffers are left behind
    return decoder, patcher


@pytest.mark.fails_switched_off("vae_qk_norm_scale", 'Tensor on device cpu is not on the expected device meta', cores=("0.36/0.37 VAE",))
def test_partially_loaded_decoder_fails_without_the_fix_and_decodes_with_it(vae):
    if FIX.detect().state != State.NEEDED:
        pytest.skip(f"this ComfyUI's VAE is {FIX.detect().state.value}: the bug does not reproduce")
    latent = torch.randn(1, 4, 2, 2, 2, device="meta")
    # grad on: the functional rms_rope (the in-place one trips kitchen's overlap check on data-less meta tensors)
    with torch.enable_grad(), real_kitchen_routing() as chosen:
        decoder, _ = partially_loaded(vae, with_fix=False)
        with pytest.raises(RuntimeError) as red:
            decoder(latent)
        assert is_device_mismatch(red.value) and chosen == ["eager"]
        assert any(entry.name == "_rms_rope1" for entry in red.traceback)  # kitchen's eager rms_norm(weight=scale)

        decoder, patcher = partially_loaded(vae, with_fix=True)
        attention = decoder.transformer_blocks[0].attn
        left_behind = attention.qk_norm_scale
        buffers = [b for _, b in decoder.named_buffers()]
        first = decode_h2d(decoder, latent, buffers)
        later = [decode_h2d(decoder, latent, buffers) for _ in range(3)]
        assert attention.qk_norm_scale is left_behind
        patcher.eject_model()
    assert first == len(buffers) and later == [0, 0, 0]  # each buffer copied once, on the first decode
    assert chosen[1:] == ["eager"] * (2 * 4)  # meta fails the CUDA constraints either way; the fix makes eager run
    assert not decoder._forward_pre_hooks and not decoder._forward_hooks  # ejected


@pytest.mark.cores("fixed VAE", "0.39 era")
def test_partially_loaded_decoder_decodes_without_the_pack_where_upstream_fixed_it(vae):
    if FIX.detect().state != State.FIXED_UPSTREAM:
        pytest.skip(f"this ComfyUI's VAE is {FIX.detect().state.value}")
    latent = torch.randn(1, 4, 2, 2, 2, device="meta")
    with torch.enable_grad(), real_kitchen_routing():
        decoder, patcher = partially_loaded(vae, with_fix=False)
        out = decoder(latent)
        patcher.eject_model()
    assert out.device.type == "meta"


@pytest.mark.cores("0.36/0.37 VAE")
def test_fully_resident_decode_is_bitwise_unchanged(vae):
    """Nothing to move: every attention gets its own scale buffer itself (not a copy, not a fresh unit scale: the
    scales here are not ones), and the decode is bit for bit the unhooked one."""
    from comfy.model_patcher import ModelPatcher

    decoder = tiny_decoder(vae)
    attention = decoder.transformer_blocks[0].attn
    with torch.no_grad():
        for block in decoder.transformer_blocks:
            block.attn.qk_norm_scale.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    latent = torch.randn(1, 4, 2, 3, 3)
    with torch.no_grad():
        expected = decoder(latent)
        patcher = ModelPatcher(decoder, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
        FIX.attach(patcher, pack_registry.key_for(FIX))
        patcher.patch_model(device_to=torch.device("cpu"))
        assert decoder._forward_pre_hooks  # injected on load
        seen = scales_seen(attention)
        got = decoder(latent)
        patcher.unpatch_model(torch.device("cpu"))
    assert len(seen) == 1 and seen[0] is attention.qk_norm_scale
    assert torch.equal(got, expected)


@pytest.mark.cores("0.36/0.37 VAE")
def test_install_hooks_the_decoder_of_the_real_vae(vae):
    with torch.device("meta"):
        model = vae.MiniMaxH3VideoVAE()
    handles = FIX.hook_loaded_model(model)
    assert model.decoder._forward_pre_hooks and model.decoder._forward_hooks
    assert not any(m._forward_pre_hooks for m in model.modules() if m is not model.decoder)
    for handle in handles:
        handle.remove()
    assert not model.decoder._forward_pre_hooks and not model.decoder._forward_hooks
