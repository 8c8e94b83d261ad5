"""Speed and memory of int8_full_precision_mm's fallback against a dense ``F.linear`` of the same shapes, one run.

    COMFYUI_PATH=/path/to/ComfyUI python benchmarks/int8_full_precision_mm.py [--tokens 256] [--vae-tokens 256] [--dtype float32] [--repeats 30]

Builds an H3-DiT-shaped MLP (fc1 hidden->2*ffn through ``forward``, fc2 ffn->hidden through
``comfy.ops.linear_input_act(..., "swiglu")``) and the four int8 Linears of one MiniMax H3 video VAE decoder block at
their real sizes (``to_qkv``, ``to_out``, ``ff.w1``, ``ff.w2``; width 2048, called through ``forward``, built with
``mixed_precision_ops(quant_config, dtype)`` as ``comfy/sd.py`` builds them; ``--vae-tokens`` tokens) from int8
ConvRot state dicts with the running ComfyUI's ``mixed_precision_ops``, makes ``torch._int_mm`` raise the MPS error (a device without int8 compute), attaches the fix
through a real ModelPatcher load and times, interleaved call by call, the fallback and a dense ``F.linear`` with the
same (dequantized) weight; then the fallback with its cache emptied before each call. Prints time ratios (medians) and
the memory the cache costs. Target: fallback / dense <= 1.1 after the first call.
"""

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # run by path: tools/minimax_hotfix is the pack (docs/testing.md, "How the tests import the pack")

TARGET = 1.1
# MiniMax H3 video VAE decoder block (ViT3DDecoder: 32 heads x 64): name, in_features, out_features
VAE_LAYERS = (("to_qkv", 2048, 6144), ("to_out", 2048, 2048), ("ff.w1", 2048, 16384), ("ff.w2", 8192, 2048))


def int8_linear(ops, in_features, out_features, dtype, seed):
    from comfy.quant_ops import QuantizedTensor

    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    quantized = QuantizedTensor.from_float(weight, "TensorWiseINT8Layout", per_channel=True, convrot=True,
                                           convrot_groupsize=256)
    conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    layer = ops.mixed_precision_ops({}, dtype).Linear(in_features, out_features, bias=False, device="cpu")
    layer.load_state_dict({"weight": quantized._qdata, "weight_scale": quantized._params.scale,
                           "comfy_quant": torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)},
                          strict=False)
    return layer


def seconds(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--vae-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    options = parser.parse_args()
    dtype = getattr(torch, options.dtype)

    from minimax_hotfix.diagnostics.comfyui_checkout import use_comfyui_checkout
    from minimax_hotfix.diagnostics.report import comfyui_version
    from minimax_hotfix.diagnostics.self_tests.int8_full_precision_mm import (
        MPS_INT_MM_ERROR,
        forget_int8_probes,
        unwrap_linear_input_act,
    )
    from minimax_hotfix.patches.int8_full_precision_mm import FIX, MARK
    from minimax_hotfix.registry import key_for

    if use_comfyui_checkout() is None:
        print("set COMFYUI_PATH to a ComfyUI checkout (its requirements installed in this Python)")
        return 2
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ops

    torch.manual_seed(0)
    fc1 = int8_linear(comfy.ops, options.hidden, 2 * options.ffn, dtype, seed=1)
    fc2 = int8_linear(comfy.ops, options.ffn, options.hidden, dtype, seed=2)
    x = torch.randn(options.tokens, options.hidden).to(dtype)
    h = torch.randn(options.tokens, 2 * options.ffn).to(dtype)
    swiglu = comfy.ops.INPUT_ACT_EAGER["swiglu"]
    dense = {fc1: fc1.weight.dequantize().to(dtype), fc2: fc2.weight.dequantize().to(dtype)}
    paths = {  # name: (layer, fallback/stock call, dense call)
        "Linear.forward": (fc1, lambda: fc1(x), lambda: F.linear(x, dense[fc1])),
        "linear_input_act swiglu": (fc2, lambda: comfy.ops.linear_input_act(fc2, h, "swiglu"),
                                    lambda: F.linear(swiglu(h), dense[fc2])),
    }
    for seed, (name, in_features, out_features) in enumerate(VAE_LAYERS, start=3):
        layer = int8_linear(comfy.ops, in_features, out_features, dtype, seed=seed)
        tokens = torch.randn(options.vae_tokens, in_features).to(dtype)
        dense[layer] = layer.weight.dequantize().to(dtype)
        paths[f"VAE {name}"] = (layer, functools.partial(layer, tokens),
                                functools.partial(F.linear, tokens, dense[layer]))
    real_int_mm = torch._int_mm

    def missing(*args, **kwargs):
        raise NotImplementedError(MPS_INT_MM_ERROR)

    torch._int_mm = missing
    forget_int8_probes()
    model = torch.nn.ModuleList(dense)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    FIX.attach(patcher, key_for(FIX))
    comfy.model_management.load_models_gpu([patcher], force_full_load=True)
    rows = []
    with torch.no_grad():
        for name, (layer, call, dense_call) in paths.items():
            dense_call()  # warm up the dense path before timing the fallback's first call
            first, first_dense = seconds(call), seconds(dense_call)
            steady, base = [], []
            for _ in range(options.repeats):
                steady.append(seconds(call))
                base.append(seconds(dense_call))
            cache = vars(layer)[MARK].weights
            uncached = []
            for _ in range(max(3, options.repeats // 5)):
                cache.clear()
                uncached.append(seconds(call))
            median = statistics.median(base)
            rows.append((name, f"{layer.in_features}->{layer.out_features}", first / first_dense,
                         statistics.median(steady) / median, statistics.median(uncached) / median, median * 1e3))
        int8_bytes = sum(layer.weight._qdata.numel() + layer.weight._params.scale.numel() * 4 for layer in dense)
        cached_bytes = sum(vars(layer)[MARK].weights.nbytes for layer in dense)
    comfy.model_management.unload_all_models()
    unwrap_linear_input_act()
    torch._int_mm = real_int_mm
    forget_int8_probes()

    print(f"int8 fallback vs dense F.linear: ComfyUI {comfyui_version()}, torch {torch.__version__}, cpu "
          f"({torch.get_num_threads()} threads), {options.dtype}, {options.tokens} tokens, "
          f"torch._int_mm made to raise the MPS error; VAE rows: {options.vae_tokens} tokens")
    header = ("path", "K->N", "first call", "after first", "no cache", "dense ms")
    print("  ".join(f"{h:>11}" if i else f"{h:<24}" for i, h in enumerate(header)))
    for name, shape, first, steady, uncached, dense_ms in rows:
        print(f"{name:<24}  {shape:>11}  {first:>11.2f}  {steady:>11.2f}  {uncached:>11.2f}  {dense_ms:>11.2f}")
    print("(ratios: time / dense F.linear time of the same shapes; medians of interleaved runs)")
    print(f"memory: int8 weights {int8_bytes / 2**20:.1f} MiB; the dequantized cache adds "
          f"{cached_bytes / 2**20:.1f} MiB = {cached_bytes / int8_bytes:.2f}x the int8 weights "
          f"({torch.finfo(dtype).bits // 8} bytes per weight), kept only while ComfyUI's minimum inference memory "
          "stays free and dropped on unload")
    worst = max(row[3] for row in rows)
    print(f"after the first call: worst fallback/dense = {worst:.2f} -> {'PASS' if worst <= TARGET else 'FAIL'} "
          f"(target <= {TARGET})")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
