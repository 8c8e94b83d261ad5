"""Per-step time and memory of MiniMax H3's DiT in fp16 with the h3_fp16_overflow fix, against plain fp16 and the
fp32 fallback, side by side in one run; needs ComfyUI (COMFYUI_PATH) with MiniMax H3.

    COMFYUI_PATH=/path/to/ComfyUI python benchmarks/h3_fp16_overflow.py [--blocks N] [--tokens N] [--rounds N] [--json out.json]

ComfyUI's own ``MiniMaxH3Model`` at the real block width (hidden 5376, 56 heads x 128, ffn 14336, text 5120;
``--tiny``: the pack's tiny H3, for the tests) with ``--blocks`` DiT blocks and random weights from a seeded
generator (the global random state is left alone), one sampling step's forward on ``--tokens`` packed tokens. The
text arrives refined, as ComfyUI's ``extra_conds`` sends it: the token refiner runs once per sampling run, not per
step, so the model is built without refiner blocks. Four modes, interleaved round by round (medians):

* fp32: what stock ComfyUI computes H3 in where the device has no bf16 (weights and compute fp32; on CUDA TF32 off);
* fp16: plain fp16, stock, no fix: the speed to match (the inputs stay in range, so it stays finite here);
* pack: the same fp16 model with the fix's hooks (``hook_dit``), its calls marked fp16 at the DiT's ``forward``;
* pack without the net: the same, without the safety net (``hook_dit(..., net=False)``): what the net costs.

Prints ms/step per mode, pack/fp16 (the fix's overhead; PASS/FAIL against ``--overhead-target``), pack/pack without
the net (the safety net's cost; PASS/FAIL against ``--net-overhead-target``, 2%), fp32/pack (the
gain over the fp32 fallback, meaningful on a GPU: a CPU without fp16 arithmetic runs fp16 matmuls slower than fp32
ones) and the memory each mode needs: its model's weights plus the forward's activation peak (CUDA:
``torch.cuda.max_memory_allocated`` over the forward; CPU, where torch's allocator keeps no statistics: the peak of the
bytes held by the tensors the forward's operators create). A first, untimed forward per mode checks that every output
is finite and that the pack's run took the fp32-stream path (its output differs from plain fp16's).

Defaults: CPU 1 block, 64 tokens, 5 rounds (about a minute on 2 cores: the CPU run shows the fix's overhead against
plain fp16); CUDA 4 blocks, 8192 tokens, 10 rounds.

Exit status: 0 every check passed, 1 a check failed, 2 no ComfyUI with MiniMax H3 here.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # run by path: tools/minimax_hotfix is the pack (docs/testing.md, "How the tests import the pack")
from minimax_hotfix.contract import remove_handles  # noqa: E402
from minimax_hotfix.diagnostics.comfyui_checkout import ComfyUIUnavailable, use_comfyui_checkout  # noqa: E402
from minimax_hotfix.kernels.h3_fp16 import TINY_H3  # noqa: E402
from minimax_hotfix.patches.h3_fp16_overflow import FIX, h3_model_class, hook_dit  # noqa: E402

CANNOT_RUN = 2
MIB = 2**20
OVERHEAD_TARGET = 1.10
NET_OVERHEAD_TARGET = 1.02
# The real H3 DiT's widths (MiniMaxH3Model's defaults on 0.33.0, named here so that a core changing them changes nothing)
H3_WIDTH = {"hidden_size": 5376, "num_attention_heads": 56, "attention_head_dim": 128, "ffn_hidden_size": 14336,
            "text_dim": 5120}
DEFAULTS = {"cpu": {"blocks": 1, "tokens": 64, "rounds": 5}, "cuda": {"blocks": 4, "tokens": 8192, "rounds": 10}}
MODES = {"fp32": "fp32 (stock fallback)", "fp16": "fp16 (stock, no fix)", "pack": "fp16 with the pack's fix",
         "no_net": "the fix without its net"}
SIGMA = 0.6


def parse_args(argv, device: torch.device) -> argparse.Namespace:
    defaults = DEFAULTS[device.type]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=defaults["blocks"],
                        help=f"DiT blocks (default here {defaults['blocks']}; the real model has 50)")
    parser.add_argument("--tokens", type=int, default=defaults["tokens"],
                        help=f"packed tokens per step: 1/8 text, 1/8 audio, the rest video (default here "
                             f"{defaults['tokens']})")
    parser.add_argument("--rounds", type=int, default=defaults["rounds"],
                        help=f"timed rounds, each mode once per round (default here {defaults['rounds']})")
    parser.add_argument("--tiny", action="store_true", help="the pack's tiny H3 widths instead of the real ones")
    parser.add_argument("--overhead-target", type=float, default=OVERHEAD_TARGET,
                        help=f"pack / fp16 at most this (default {OVERHEAD_TARGET})")
    parser.add_argument("--net-overhead-target", type=float, default=NET_OVERHEAD_TARGET,
                        help=f"pack / pack without the safety net at most this (default {NET_OVERHEAD_TARGET})")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.tokens < 32 or args.blocks < 1 or args.rounds < 1:
        parser.error("needs --tokens >= 32, --blocks >= 1, --rounds >= 1")
    return args


def build_config(args) -> dict:
    return {**(TINY_H3 if args.tiny else H3_WIDTH), "num_layers": args.blocks, "token_refiner_num_layers": 0}


def fill_weights(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Deterministic weights that keep the activations in fp16's range: matrices uniform in +-1/sqrt(fan_in) (each
    output about the size of its inputs), norm weights 1, biases 0, the rotary frequencies as the real model's."""
    with torch.no_grad():
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            if name == "rope.inv_freq":
                tensor.copy_(1.0 / 10000.0 ** (torch.arange(tensor.numel(), dtype=torch.float32) / tensor.numel()))
            elif tensor.dim() > 1:
                bound = 1.0 / math.sqrt(tensor.shape[-1])
                tensor.uniform_(-bound, bound, generator=generator)
            elif name.endswith(".bias"):
                tensor.zero_()
            else:
                tensor.fill_(1.0)


def build_models(model_class, config: dict, device: torch.device) -> dict:
    """The fp32 model and the fp16 model (the plain fp16 and the pack modes share it), equal weights, as ComfyUI
    builds a model whose weights are stored in its compute dtype (``comfy.ops.disable_weight_init``)."""
    import comfy.ops

    ops = comfy.ops.disable_weight_init
    fp32 = model_class(**config, dtype=torch.float32, device=device, operations=ops).to(device)
    fill_weights(fp32, torch.Generator(device=device).manual_seed(0))
    fp16 = model_class(**config, dtype=torch.float16, device=device, operations=ops).to(device)
    with torch.no_grad():
        for source, target in zip(fp32.state_dict().values(), fp16.state_dict().values(), strict=True):
            target.copy_(source)
    return {"fp32": fp32.eval().requires_grad_(False), "fp16": fp16.eval().requires_grad_(False)}  # as ComfyUI loads


def step_inputs(model, tokens: int, device: torch.device) -> dict:
    """One sampling step's forward arguments in fp32 (cast per mode): ``tokens`` packed rows, 1/8 text (refined,
    ``hidden_size`` wide), 1/8 stereo audio, the rest one video latent frame two patches high, and the packed layout
    that ``extra_conds`` builds once per sampling run."""
    from comfy.ldm.minimax.model import PackedLayout

    text, audio_frames = tokens // 8, tokens // 16
    video_rows = tokens - text - 2 * audio_frames
    generator = torch.Generator().manual_seed(1)
    video = torch.randn(1, model.latents_dim, 1, 2, 2 * video_rows, generator=generator)
    audio = torch.randn(1, model.audio_latents_dim, 2, audio_frames, generator=generator)
    context = torch.randn(1, text, model.hidden_size, generator=generator)
    layout = PackedLayout(text, 1, 2, 2 * video_rows, audio_frames)
    return {"x": [video.to(device), audio.to(device)], "timestep": torch.tensor([SIGMA * 1000.0], device=device),
            "context": context.to(device), "transformer_options": {}, "minimax_payload": {"layout": layout}}


def in_dtype(inputs: dict, dtype: torch.dtype) -> dict:
    """``inputs`` as ComfyUI's ``_apply_model`` hands them to a model computing in ``dtype``."""
    return {**inputs, "x": [part.to(dtype) for part in inputs["x"]], "context": inputs["context"].to(dtype)}


@contextlib.contextmanager
def fix_hooks(mode: str, model):
    """The fix's hooks on ``model`` for the pack's modes (with and without its net), nothing for the others."""
    handles = hook_dit(model, FIX, net=mode == "pack") if mode in ("pack", "no_net") else []
    try:
        yield
    finally:
        remove_handles(handles)


def forward(model, inputs) -> list:
    with torch.inference_mode():  # as ComfyUI's executor runs a prompt
        return model(**inputs)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_step(model, inputs, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    forward(model, inputs)
    synchronize(device)
    return time.perf_counter() - start


class CreatedTensorBytes(TorchDispatchMode):
    """The peak of the bytes held, at once, by the tensors the operators inside it create (views and in-place
    results of tensors that existed already aside), each counted until it is freed: the activation memory of a CPU
    forward, where torch's allocator keeps no statistics."""

    def __init__(self):
        super().__init__()
        self.held: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.held = {key: held for key, held in self.held.items() if not held[0].expired()}
        operands = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in operands:
                storage = tensor.untyped_storage()
                self.held.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.held.values()))
        return out


def probe(model, inputs, device) -> tuple[torch.Tensor, int]:
    """One untimed forward (the warm-up): its outputs flattened into one fp32 vector, and its activation peak in
    bytes."""
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = forward(model, inputs)
        synchronize(device)
        activations = torch.cuda.max_memory_allocated(device) - before
    else:
        with CreatedTensorBytes() as counted:
            out = forward(model, inputs)
        activations = counted.peak
    return torch.cat([part.reshape(-1).to(torch.float32).cpu() for part in out]), activations


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


@contextlib.contextmanager
def tf32_off():
    """fp32 matmuls and convolutions in full fp32 on CUDA, as on the devices without bf16 (none has TF32)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def measure(args, model_class, device) -> dict:
    config = build_config(args)
    models = build_models(model_class, config, device)
    step = step_inputs(models["fp32"], args.tokens, device)
    runs = {mode: (models["fp32" if mode == "fp32" else "fp16"],
                   in_dtype(step, torch.float32 if mode == "fp32" else torch.float16)) for mode in MODES}
    outputs, activations = {}, {}
    for mode, (model, inputs) in runs.items():
        with fix_hooks(mode, model):
            outputs[mode], activations[mode] = probe(model, inputs, device)
    times = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        order = list(MODES)[round_ % len(MODES):] + list(MODES)[:round_ % len(MODES)]  # each mode in each place
        for mode in order:
            model, inputs = runs[mode]
            with fix_hooks(mode, model):
                times[mode].append(seconds_per_step(model, inputs, device))
    return {
        "config": config,
        "ms_per_step": {mode: statistics.median(times[mode]) * 1e3 for mode in MODES},
        "ms_per_step_min": {mode: min(times[mode]) * 1e3 for mode in MODES},
        "pack_over_fp16": statistics.median(p / f for p, f in zip(times["pack"], times["fp16"], strict=True)),
        "pack_over_no_net": statistics.median(p / n for p, n in zip(times["pack"], times["no_net"], strict=True)),
        "fp32_over_pack": statistics.median(f / p for f, p in zip(times["fp32"], times["pack"], strict=True)),
        "weight_bytes": {mode: weight_bytes(model) for mode, (model, _) in runs.items()},
        "activation_bytes": activations,
        "finite": all(bool(torch.isfinite(out).all()) for out in outputs.values()),
        "fp32_stream_ran": not torch.equal(outputs["pack"], outputs["fp16"]),
        "net_recomputed_nothing": torch.equal(outputs["pack"], outputs["no_net"]),
        "max_abs_diff_from_fp32": {mode: (outputs[mode] - outputs["fp32"]).abs().max().item()
                                   for mode in ("fp16", "pack", "no_net")},
    }


def report(args, figures: dict, device: torch.device) -> None:
    config = figures["config"]
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"MiniMax H3 DiT, one sampling step: ComfyUI's {figures['model_class']}, hidden {config['hidden_size']} "
          f"({config['num_attention_heads']} heads x {config['attention_head_dim']}), ffn {config['ffn_hidden_size']}, "
          f"{args.blocks} block(s), {args.tokens} packed tokens; {where} (torch {torch.__version__}); "
          f"{args.rounds} interleaved rounds; fix detected: {figures['detected']}")
    diffs = figures["max_abs_diff_from_fp32"]
    print(f"probe: outputs {'finite' if figures['finite'] else 'NOT FINITE'} in every mode; the pack's run "
          f"{'took' if figures['fp32_stream_ran'] else 'did NOT take'} the fp32-stream path (its output "
          f"{'differs from' if figures['fp32_stream_ran'] else 'equals'} plain fp16's); max abs diff from fp32: "
          f"fp16 {diffs['fp16']:.3g}, pack {diffs['pack']:.3g}")
    measured_by = ("torch.cuda.max_memory_allocated over the forward" if device.type == "cuda"
                   else "peak bytes of the tensors the forward creates")
    for mode, label in MODES.items():
        weights, activations = figures["weight_bytes"][mode], figures["activation_bytes"][mode]
        print(f"  {label:26} {figures['ms_per_step'][mode]:10.2f} ms/step (min {figures['ms_per_step_min'][mode]:.2f})"
              f"   memory {(weights + activations) / MIB:9.1f} MiB = weights {weights / MIB:.1f} + activations "
              f"{activations / MIB:.1f}")
    print(f"  (activations: {measured_by})")
    verdict = "PASS" if figures["overhead_within_target"] else "FAIL"
    print(f"pack / fp16: {figures['pack_over_fp16']:.3f} (median of per-round ratios); target <= "
          f"{args.overhead_target:.2f}: {verdict}")
    net_verdict = "PASS" if figures["net_overhead_within_target"] else "FAIL"
    print(f"pack / pack without the safety net: {figures['pack_over_no_net']:.3f} (median of per-round ratios; the "
          f"net recomputed {'nothing' if figures['net_recomputed_nothing'] else 'A CALL'}); target <= "
          f"{args.net_overhead_target:.2f}: {net_verdict}")
    gain_note = "" if device.type == "cuda" else " (not meaningful on a CPU: its fp16 matmuls are no faster)"
    print(f"fp32 / pack: {figures['fp32_over_pack']:.2f}, the fp16 gain over the fp32 fallback{gain_note}")


def main(argv=None) -> int:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    args = parse_args(argv, device)
    try:
        use_comfyui_checkout()  # COMFYUI_PATH where set; the GPU check has put its ComfyUI on the path already
    except ComfyUIUnavailable as exc:
        print(exc)
        return CANNOT_RUN
    model_class = h3_model_class()
    if not model_class:
        print("needs ComfyUI with MiniMax H3's DiT (comfy.ldm.minimax.model): set COMFYUI_PATH")
        return CANNOT_RUN
    started = time.perf_counter()
    with tf32_off():
        figures = {"model_class": model_class.__name__, "device": str(device), "detected": FIX.detect().state.value,
                   **measure(args, model_class, device)}
    figures["overhead_target"] = args.overhead_target
    figures["overhead_within_target"] = figures["pack_over_fp16"] <= args.overhead_target
    figures["net_overhead_target"] = args.net_overhead_target
    figures["net_overhead_within_target"] = figures["pack_over_no_net"] <= args.net_overhead_target
    figures["wall_s"] = time.perf_counter() - started
    report(args, figures, device)
    passed = (figures["finite"] and figures["fp32_stream_ran"] and figures["net_recomputed_nothing"]
              and figures["overhead_within_target"] and figures["net_overhead_within_target"])
    print(f"{'all checks passed' if passed else 'a check failed'} in {figures['wall_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
