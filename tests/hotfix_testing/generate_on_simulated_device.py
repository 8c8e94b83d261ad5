"""Seed 003 end to end on the simulated accelerator: ``generate(cache_implementation="static")`` of a tiny Gemma 3
and a tiny Qwen3 whose weights are on ``npu:0`` while the inputs stay in CPU RAM, without and with the pack's
``transformers_static_cache``, against the same model all on the CPU. Prints one JSON object.

Run in a subprocess by tests/test_transformers_static_cache.py (the device is registered process-wide), once per
transformers version: the venv's and ``.venv/extra/transformers-5.19`` first on PYTHONPATH. The accelerator module is
loaded from its file, not from its folder: with the stand-in ``torch_npu`` importable, transformers would take this
for an Ascend machine and import NPU kernels that the stand-in does not have.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
PROMPT = torch.tensor([[0, 5, 6, 7, 8], [3, 4, 5, 6, 7]])
PADDED = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding: the mask is not skipped
GENERATE = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0,
                disable_compile=True)


def tiny_qwen3():
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64)
    return transformers.Qwen3ForCausalLM(config).eval()


def tiny_gemma3():
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           max_position_embeddings=64, sliding_window=4,
                                           layer_types=["sliding_attention", "full_attention"])
    return transformers.Gemma3ForCausalLM(config).eval()


TINY_MODELS = {"qwen3": tiny_qwen3, "gemma3": tiny_gemma3}


def simulated_accelerator():
    from simulated_device import simulated_accelerator  # tests/ on the path, not the folder (its torch_npu stand-in)

    return simulated_accelerator


def on_device(make_model, device, accelerator) -> dict:
    """One generate() with the model on ``device`` and the inputs on the CPU: ids, or the error text."""
    model = make_model().to(device)
    accelerator.reset_counters()
    try:
        ids = model.generate(input_ids=PROMPT, attention_mask=PADDED, **GENERATE).tolist()
    except RuntimeError as exc:
        return {"error": str(exc).splitlines()[0]}
    return {"ids": ids, "host_to_device": accelerator.host_to_device()}


def main() -> dict:
    import transformers

    from minimax_hotfix import registry as pack_registry
    from minimax_hotfix.patches import transformers_static_cache as shim

    # The shim probes transformers once, on FakeTensor cuda; run it before the device's dispatch mode is entered, as
    # on real hardware, where no mode is active (the simulated device's mode does not take FakeTensors).
    verdict = shim.FIX.verdict()
    accelerator = simulated_accelerator()
    accelerator.install()
    accelerator.enter_in_every_thread()
    device = torch.device(accelerator.DEVICE_TYPE, 0)
    state = pack_registry.status(shim.FIX).state
    report = {"transformers": transformers.__version__, "fix_state": state.name,
              "probe": {"masks": verdict.masks.state.name, "tp_heads": verdict.tp_heads.state.name}, "models": {}}
    for name, make_model in TINY_MODELS.items():
        shim.FIX.uninstall()
        cpu = make_model().generate(input_ids=PROMPT, attention_mask=PADDED, **GENERATE).tolist()
        stock = on_device(make_model, device, accelerator)
        if state is pack_registry.State.NEEDED:  # what the pack does at load: install only where it applies
            shim.FIX.install()
        pack = on_device(make_model, device, accelerator)
        shim.FIX.uninstall()
        report["models"][name] = {"cpu": cpu, "stock": stock, "pack": pack}
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
