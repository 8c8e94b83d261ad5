"""Benchmark for the vae_qk_norm_scale fix; needs COMFYUI_PATH at a ComfyUI whose MiniMax VAE has qk_norm_scale.

    COMFYUI_PATH=/path/to/ComfyUI python benchmarks/vae_qk_norm_scale.py [--rounds 30]

1. Overhead on a fully resident decoder (CPU): decode time with the fix's hooks / without, measured interleaved in
   one run (medians over the rounds). Target: <= 1.01. Also the cost of one hooked call, for scaling to a GPU.
2. Host-to-device copies of model buffers per decode, decoder partially loaded onto ``meta`` (the stand-in GPU):
   with the fix, and without it (the running core's own behaviour: a crash on a buggy core, a copy per attention
   call on one with the upstream call-site fix).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / folder) for folder in ("tools", "tests")]  # run by path: the pack (tools/minimax_hotfix) and the tests' helpers (hotfix_testing), as pytest's pythonpath
from minimax_hotfix.contract import State  # noqa: E402
from minimax_hotfix.diagnostics.comfyui_checkout import use_comfyui_checkout  # noqa: E402
from minimax_hotfix.diagnostics.devices import HostToDeviceCopies  # noqa: E402
from minimax_hotfix.diagnostics.kitchen import real_kitchen_routing  # noqa: E402
from minimax_hotfix.patches import vae_qk_norm_scale  # noqa: E402

FIX = vae_qk_norm_scale.FIX
H3_DECODER_BUFFERS = 36 + 2  # one qk_norm_scale per block, the rotary inv_freq, mask_token


def comfy_vae():
    if not use_comfyui_checkout():
        sys.exit("set COMFYUI_PATH to a ComfyUI checkout")
    import comfy.ldm.modules.attention
    import comfy.ops
    from comfy.ldm.minimax import vae

    if not vae_qk_norm_scale.owns_scale_buffer(vae.Attention):
        sys.exit("this ComfyUI's VAE Attention has no qk_norm_scale (before 0.36): nothing to measure")
    if "residual" not in inspect.signature(comfy.ops.linear_input_act).parameters:
        # a 0.33.0 core with a newer vae.py laid over it: a simulated core, built from a checkout's tests/
        from hotfix_testing.newer_linear_input_act import use_newer_linear_input_act

        use_newer_linear_input_act()
    return vae, comfy.ldm.modules.attention


def decoder(vae, heads, dim_head, layers):
    torch.manual_seed(0)
    model = vae.ViT3DDecoder(patch_size=2, patch_size_t=1, in_channels=24, out_channels=3, num_layers=layers,
                             heads=heads, dim_head=dim_head)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    return model


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def overhead(vae, rounds: int) -> None:
    model = decoder(vae, heads=8, dim_head=64, layers=4)
    latent = torch.randn(1, 24, 2, 8, 8)
    with torch.no_grad():
        decode = lambda: model(latent)  # noqa: E731
        for _ in range(3):
            decode()
        plain, fixed = [], []
        for round_ in range(rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for with_fix in order:
                handles = FIX.hook_loaded_model(model) if with_fix else []
                (fixed if with_fix else plain).append(timed(decode))
                for handle in handles:
                    handle.remove()
    paired = statistics.median(f / p for f, p in zip(fixed, plain, strict=True))
    print(f"fully resident decoder (8 heads x 64, 4 layers, {latent.shape[2] * 64 + 5} tokens, CPU, "
          f"{torch.get_num_threads()} threads), {rounds} interleaved rounds:")
    print(f"  decode without fix: min {min(plain) * 1e3:.2f} ms, median {statistics.median(plain) * 1e3:.2f} ms; "
          f"with fix: min {min(fixed) * 1e3:.2f} ms, median {statistics.median(fixed) * 1e3:.2f} ms")
    print(f"  patched/unpatched: {min(fixed) / min(plain):.4f} (minima), {paired:.4f} (median of back-to-back "
          f"pairs); target <= 1.01")

    probe = BufferTree(H3_DECODER_BUFFERS)
    x = torch.zeros(1)
    probe_calls = 10000
    best_of_five = lambda: min(timed(lambda: [probe(x) for _ in range(probe_calls)]) for _ in range(5))  # noqa: E731
    bare = best_of_five()
    handles = vae_qk_norm_scale.hook_decoders([probe])
    hooked = best_of_five()
    for handle in handles:
        handle.remove()
    print(f"  the hooks cost {(hooked - bare) / probe_calls * 1e6:.2f} us per decoder call with the full H3 decoder's "
          f"{H3_DECODER_BUFFERS} buffers, all resident")


class BufferTree(torch.nn.Module):
    """As many buffer-owning submodules as the full decoder, and a forward that does nothing: the hooks' cost alone."""

    def __init__(self, count: int):
        super().__init__()
        self.owners = torch.nn.ModuleList(vae_qk_norm_scale.UnitScaleRmsRope(64, torch.float32) for _ in range(count))

    def forward(self, x):
        return x


def copies_per_decode(vae, attention_module) -> None:
    import comfy.model_management
    from comfy.model_patcher import ModelPatcher

    vae.optimized_attention = attention_module.attention_pytorch  # sub-quad asks meta for its free memory
    latent = torch.randn(1, 24, 2, 4, 4, device="meta")
    print("buffer host-to-device copies per decode, partial load onto meta (decodes 1..4):")
    for with_fix in (True, False):
        model = decoder(vae, heads=2, dim_head=64, layers=4)
        patcher = ModelPatcher(model, load_device=torch.device("meta"), offload_device=torch.device("cpu"))
        if with_fix:
            FIX.attach(patcher, "benchmark")
        patcher.patch_model(device_to=torch.device("meta"),
                            lowvram_model_memory=comfy.model_management.module_size(model) // 2)
        buffers = [b for _, b in model.named_buffers()]
        counts, failure = [], ""
        with torch.enable_grad(), real_kitchen_routing():
            for _ in range(4):
                try:
                    with HostToDeviceCopies() as counted:
                        model(latent)
                except RuntimeError as exc:
                    failure = f" then fails: {str(exc).splitlines()[0]}"
                    break
                counts.append(counted.made_from(buffers))
        patcher.eject_model()
        print(f"  {'with the fix   ' if with_fix else 'without the fix'}: {counts}{failure}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps a shared machine's noise down)")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    rounds = options.rounds
    vae, attention_module = comfy_vae()
    state = FIX.detect().state
    print(f"detected: {state.value}" + ("" if state is State.NEEDED else
                                        " (the pack would not attach the fix here; attached directly to compare)"))
    overhead(vae, rounds)
    copies_per_decode(vae, attention_module)


if __name__ == "__main__":
    main()
