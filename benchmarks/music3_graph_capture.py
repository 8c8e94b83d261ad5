"""Opt-in GPU check of the two MiniMax Music 3 CUDA-graph fixes (music3_graph_buffers, music3_graph_capture).

    python benchmarks/music3_graph_capture.py            # about a minute on one GPU; no network; exits 2 without CUDA
    python benchmarks/music3_graph_capture.py --json out.json

On a tiny Llama-shaped decoder decoded like Music 3's AR loop, with per-layer CUDA graphs captured and replayed the
way ``comfy.model_prefetch`` does it (diagnostics/tiny_decoder.py), side by side in one run:

1. noise: graphs without static buffers vs graphs off (the stale-address replay of #16222: max abs diff > 0), then
   graphs with the pack's pooled decode buffers (max abs diff must be 0);
2. capture: a GGUF-style Q4_0 layer dequantized inside capture, in a child process because a failed capture can
   abort it (the #16002 error text must appear), then the pack's capture policy: that unit runs eagerly, every other
   unit is captured, output equal to graphs off;
3. speed: the AR loop with graphs disabled vs fixed graphs: steady-state ms per decode step (the difference between
   runs of ``--steps`` and twice as many steps, so the per-run capture cost drops out; goal ``--speed-goal``), and
   the ratio of whole runs, captures included;
4. pinning, the alternative to not capturing a host-resident unit: that unit eager (the policy) vs its weight pinned
   and captured, time per step and the pinned host memory it costs.

Exit status: 0 all checks pass, 1 a check failed, 2 no CUDA here ("needs CUDA").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # run by path: tools/minimax_hotfix is the pack (docs/testing.md, "How the tests import the pack")
from minimax_hotfix.diagnostics.emulated_capture import CAPTURE_HOST_COPY_ERROR, capture_allowed_on  # noqa: E402
from minimax_hotfix.diagnostics.tiny_decoder import (  # noqa: E402
    CudaGraphs,
    HostWeightLinear,
    TinyConfig,
    build_decoder,
    decode_hidden_states,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NEEDS_CUDA = 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=256, help="decode steps per AR run (default 256)")
    # small and deep, like a decode step: launch-bound, which is what graphs are for (Music 3: 36 layers, batch 2)
    parser.add_argument("--layers", type=int, default=24, help="decoder layers = graph units (default 24)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--batch", type=int, default=2, help="2 like Music 3 (conditioned + unconditioned)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=3, help="timed AR runs per mode; the best counts")
    parser.add_argument("--gguf-layer", type=int, default=1, help="the layer whose down_proj is GGUF-style Q4_0")
    parser.add_argument("--speed-goal", type=float, default=4.0, help="fixed graphs / graphs disabled (default 4)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--capture-error-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 <= args.gguf_layer < args.layers:
        parser.error("--gguf-layer must name one of the --layers")
    return args


def config_for(args) -> TinyConfig:
    return TinyConfig(hidden=args.hidden, heads=args.heads, layers=args.layers, intermediate=args.intermediate,
                      capacity=2 * args.steps + 1, vocab=512)


def model_for(args, device, q4_layers=()):
    return build_decoder(config_for(args), device, DTYPES[args.dtype], q4_layers=q4_layers)


def decoded(model, args, device, runner=None, static_buffers=False, steps=None):
    with torch.no_grad():
        return decode_hidden_states(model, steps or args.steps, runner=runner, static_buffers=static_buffers,
                                    device=device, dtype=DTYPES[args.dtype], batch=args.batch)


def max_abs_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def best_seconds(args, run) -> float:
    times = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def ms_per_step(args, run) -> tuple[float, float]:
    """(steady-state ms per decode step, seconds for a whole run of 2 x --steps steps)."""
    short = best_seconds(args, lambda: run(args.steps))
    long = best_seconds(args, lambda: run(2 * args.steps))
    return (long - short) * 1000 / args.steps, long


def capture_error_child(args) -> int:
    """Capture every unit, the Q4_0 one included; print the error. Runs alone: a failed capture may abort."""
    device = torch.device("cuda")
    model = model_for(args, device, q4_layers=(args.gguf_layer,))
    try:
        decoded(model, args, device, runner=CudaGraphs(device), static_buffers=True)
    except RuntimeError as exc:
        while exc is not None:  # ending a failed capture raises again; the cause is further down the chain
            print(f"capture failed: {type(exc).__name__}: {exc}", flush=True)
            exc = exc.__cause__ or exc.__context__
        return 0
    print("capture succeeded", flush=True)
    return 1


class Report:
    def __init__(self):
        self.figures, self.failed = {}, 0

    def check(self, section, text, passed):
        self.failed += not passed
        print(f"[{section:7}] {text:100} {'ok' if passed else 'FAIL'}", flush=True)


def noise_checks(args, device, report):
    model = model_for(args, device)
    reference = decoded(model, args, device)
    stale = max_abs_diff(decoded(model, args, device, runner=CudaGraphs(device)), reference)
    runner = CudaGraphs(device)
    fixed = max_abs_diff(decoded(model, args, device, runner=runner, static_buffers=True), reference)
    report.figures.update(stale_replay_max_abs_diff=stale, fixed_max_abs_diff=fixed)
    report.check("noise", f"graphs without static buffers: max abs diff vs graphs off = {stale:.4g} "
                          "(stale replay reproduced)", stale > 0)
    report.check("noise", f"graphs with pooled decode buffers ({len(runner.graphs)} units captured): "
                          f"max abs diff vs graphs off = {fixed:.4g}", fixed == 0 and len(runner.graphs) == args.layers)


def capture_checks(args, device, report, argv):
    child = subprocess.run([sys.executable, __file__, *argv, "--capture-error-child"], capture_output=True,
                           text=True, timeout=240)
    output = child.stdout + child.stderr
    reproduced = CAPTURE_HOST_COPY_ERROR in output
    report.figures.update(capture_child_exit=child.returncode, capture_error_reproduced=reproduced)
    report.check("capture", f"Q4_0 unit captured (child exit {child.returncode}): "
                            f"{'pinned-memory capture error raised' if reproduced else 'no capture error'}",
                 reproduced)
    if not reproduced:
        print(output[-2000:])
    model = model_for(args, device, q4_layers=(args.gguf_layer,))
    reference = decoded(model, args, device)
    runner = CudaGraphs(device, capture_allowed=capture_allowed_on(device))
    diff = max_abs_diff(decoded(model, args, device, runner=runner, static_buffers=True), reference)
    report.figures.update(policy_units_captured=len(runner.graphs), policy_units_eager=len(runner.refused),
                          policy_max_abs_diff=diff)
    report.check("capture", f"policy: {len(runner.refused)} unit eager, {len(runner.graphs)} captured; "
                            f"max abs diff vs graphs off = {diff:.4g}",
                 diff == 0 and len(runner.refused) == 1 and len(runner.graphs) == args.layers - 1)


def speed_checks(args, device, report):
    model = model_for(args, device)
    decoded(model, args, device, runner=CudaGraphs(device), static_buffers=True)  # warm-up: kernels, allocator
    eager, eager_run = ms_per_step(args, lambda steps: decoded(model, args, device, steps=steps))
    graphed, graphed_run = ms_per_step(args, lambda steps: decoded(model, args, device, runner=CudaGraphs(device),
                                                                   static_buffers=True, steps=steps))
    ratio, run_ratio = eager / graphed, eager_run / graphed_run
    report.figures.update(graphs_disabled_ms_per_step=eager, fixed_graphs_ms_per_step=graphed, speedup=ratio,
                          graphs_disabled_run_s=eager_run, fixed_graphs_run_s=graphed_run, run_speedup=run_ratio)
    report.check("speed", f"AR loop: graphs disabled {eager:.3f} ms/step, fixed graphs {graphed:.3f} ms/step: "
                          f"{ratio:.2f}x (goal >= {args.speed_goal}x); whole {2 * args.steps}-step runs with "
                          f"captures {eager_run:.2f} s vs {graphed_run:.2f} s: {run_ratio:.2f}x",
                 ratio >= args.speed_goal)


def pinning_checks(args, device, report):
    def with_host_layer(pinned):
        model = model_for(args, device)
        weight = model.layers[0].up_proj.weight.detach().cpu()
        model.layers[0].up_proj = HostWeightLinear(weight.pin_memory() if pinned else weight)
        return model, weight.numel() * weight.element_size()

    results = {}
    for pinned in (False, True):
        model, nbytes = with_host_layer(pinned)
        reference = decoded(model, args, device)
        runner = CudaGraphs(device, capture_allowed=capture_allowed_on(device))
        diff = max_abs_diff(decoded(model, args, device, runner=runner, static_buffers=True), reference)
        ms, _ = ms_per_step(args, lambda steps, model=model: decoded(model, args, device, runner=CudaGraphs(
            device, capture_allowed=capture_allowed_on(device)), static_buffers=True, steps=steps))
        results[pinned] = (ms, len(runner.graphs), diff)
    (eager_ms, eager_units, eager_diff), (pinned_ms, pinned_units, pinned_diff) = results[False], results[True]
    report.figures.update(host_unit_eager_ms_per_step=eager_ms, host_unit_pinned_captured_ms_per_step=pinned_ms,
                          pinned_host_bytes=nbytes)
    report.check("pinning", f"host-resident unit: eager (policy) {eager_ms:.3f} ms/step, {eager_units} units "
                            f"captured; pinned + captured {pinned_ms:.3f} ms/step, {pinned_units} captured, "
                            f"+{nbytes / 2**20:.2f} MiB pinned host memory",
                 eager_diff == 0 and pinned_diff == 0 and eager_units == args.layers - 1
                 and pinned_units == args.layers)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA: this check captures real CUDA graphs; run it on a machine with an NVIDIA GPU "
              "(the CPU parts run in tests/test_music3_gpu_check.py)")
        return NEEDS_CUDA
    if args.capture_error_child:
        return capture_error_child(args)
    device = torch.device("cuda")
    print(f"MiniMax Music 3 CUDA-graph check on {torch.cuda.get_device_name(device)} (torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}); decoder: {args.layers} layers, hidden {args.hidden}, {args.dtype}, "
          f"batch {args.batch}, {args.steps} steps", flush=True)
    report = Report()
    started = time.perf_counter()
    noise_checks(args, device, report)
    capture_checks(args, device, report, argv)
    speed_checks(args, device, report)
    pinning_checks(args, device, report)
    report.figures["wall_s"] = time.perf_counter() - started
    print(f"{'all checks passed' if not report.failed else f'{report.failed} check(s) failed'} "
          f"in {report.figures['wall_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(report.figures, indent=2))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
