"""The opt-in GPU check (benchmarks/music3_graph_capture.py) stays runnable: its argument parsing, model construction
and static-buffer logic run here on CPU (graphs emulated), and without CUDA it exits clearly."""


import pytest
import torch

from minimax_hotfix.diagnostics.emulated_capture import capture_allowed_on
from minimax_hotfix.diagnostics.tiny_decoder import EmulatedGraphs, GGUFStyleQ4Linear

SMALL = ["--steps", "8", "--layers", "3", "--hidden", "64", "--heads", "4", "--intermediate", "128", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def script():
    from minimax_hotfix.benchmarks import music3_graph_capture  # benchmarks/, reached through the pack's folder

    return music3_graph_capture


def test_defaults_fit_the_documented_budget(script):
    args = script.parse_args([])
    assert (args.steps, args.layers, args.batch, args.dtype, args.speed_goal) == (256, 24, 2, "bf16", 4.0)
    assert script.config_for(args).capacity > 2 * args.steps  # the static cache holds the longer timed run


def test_bad_arguments_are_refused(script):
    with pytest.raises(SystemExit):
        script.parse_args(["--gguf-layer", "3", "--layers", "3"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check itself runs there")
def test_without_cuda_it_says_so_and_exits_2(script, capsys):
    assert script.main(SMALL) == script.NEEDS_CUDA
    assert "needs CUDA" in capsys.readouterr().out


def test_model_construction_marks_the_gguf_layer(script):
    args = script.parse_args(SMALL + ["--gguf-layer", "2"])
    model = script.model_for(args, "cpu", q4_layers=(args.gguf_layer,))
    assert isinstance(model.layers[2].down_proj, GGUFStyleQ4Linear)
    refused = [i for i, layer in enumerate(model.layers) if not capture_allowed_on("cpu")(layer)]
    assert refused == [2]


def test_static_buffer_logic_red_and_green_on_cpu(script):
    args = script.parse_args(SMALL)
    model = script.model_for(args, "cpu")
    reference = script.decoded(model, args, "cpu")
    assert reference.shape == (args.steps, args.batch, 1, args.hidden)
    stale = script.decoded(model, args, "cpu", runner=EmulatedGraphs())
    fixed = script.decoded(model, args, "cpu", runner=EmulatedGraphs(), static_buffers=True)
    assert script.max_abs_diff(stale, reference) > 0
    assert script.max_abs_diff(fixed, reference) == 0


def test_report_counts_failures(script, capsys):
    report = script.Report()
    report.check("noise", "fine", True)
    report.check("speed", "too slow", False)
    assert report.failed == 1 and "FAIL" in capsys.readouterr().out
