"""The known errors (registry/known_errors.py): each against the README troubleshooting section it names, and every
error heading there against them; the matcher on the errors as ComfyUI reports them; and what the extension is told
about a failed prompt (``explain``): fix the workflow, insert an Apply node after one loader, or report the fix's
state when the model already goes through the pack or the fix is process-wide."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hotfix_testing.user_workflows import music3_gguf
from hotfix_testing.workflow_api import load, ui_to_api
from minimax_hotfix import swap_loaders
from minimax_hotfix.contract import Fix, State, Status, Target
from minimax_hotfix.registry import fix_module_names
from minimax_hotfix.registry.known_errors import KNOWN_ERRORS, Remedy, explain, known_error
from minimax_hotfix.swap_loaders import api_model_sources

ROOT = Path(__file__).resolve().parents[1]
SPECS = load(Path(__file__).with_name("workflow_node_specs.json"))["nodes"]
OUTPUTS = {**{name: tuple(spec["output"]) for name, spec in SPECS.items()},
           "CheckpointLoaderSimple": ("MODEL", "CLIP", "VAE"), "LoraLoader": ("MODEL", "CLIP"),
           "MiniMaxHotfixApplyVAE": ("VAE",), "MiniMaxHotfixApplyModel": ("MODEL",)}
APPLY_NODE = {io_type: apply_type for io_type, (apply_type, _) in swap_loaders.APPLY_NODE.items()}


def output_types(class_type: str) -> tuple:
    return OUTPUTS.get(class_type, ())


def readme_sections() -> dict[str, str]:
    """The README troubleshooting's error sections by their heading's first code span: heading and text."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    troubleshooting = readme[readme.index("## Troubleshooting"):readme.index("## For developers")]
    sections = re.split(r"(?m)^(?=### )", troubleshooting)[1:]
    return {re.match(r"### `([^`]+)`", section).group(1): section for section in sections
            if section.startswith("### `")}


def test_every_error_heading_of_the_readme_troubleshooting_is_a_known_error_and_back():
    assert set(readme_sections()) == {entry.readme for entry in KNOWN_ERRORS}


@pytest.mark.parametrize("entry", KNOWN_ERRORS, ids=lambda entry: f"{entry.fix}:{entry.models or entry.message[0]}")
def test_each_known_error_is_told_in_its_readme_section(entry):
    """The section that explains it names its fix, the message texts it matches and the traceback texts that tell
    it apart from the other fixes with that message."""
    sections = readme_sections()
    assert entry.readme in sections, f"the README troubleshooting has no heading ### `{entry.readme}`"
    section = sections[entry.readme]
    for text in (entry.fix, *entry.message, *entry.traceback):
        assert text in section, f"{text!r} is not in the README section {entry.readme!r}"


def test_each_known_error_names_a_fix_and_what_repairs_it():
    assert {entry.fix for entry in KNOWN_ERRORS} <= set(fix_module_names())
    for entry in KNOWN_ERRORS:
        assert bool(entry.models) is (entry.remedy is Remedy.LOADERS), entry
        assert set(entry.models) <= set(APPLY_NODE), entry


def frames(*paths: str) -> str:
    """A traceback as ComfyUI sends it (``traceback.format_tb``), joined."""
    return "".join(f'  File "{path}", line 10, in forward\n    x = call(x)\n' for path in paths)


COMFY = "/home/me/ComfyUI"
MIXED = "Expected all tensors to be on the same device, but found at least two devices, {} and cpu!"
INT8 = "The operator 'aten::_int_mm' is not currently implemented for the MPS device. If you want this op to be added"
# cuBLASLt on a V100 (pytorch/pytorch#106840), raised at comfy-kitchen's eager int8 GEMM
VOLTA_INT_MM = ("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul with transpose_mat1 0 transpose_mat2 "
                "0 m 16 n 17 k 16 mat1_ld 16 mat2_ld 16 result_ld 16 abType 3 cType 10 computeType 72 scaleType 10")
EAGER_INT8 = "/venv/comfy_kitchen/backends/eager/quantization.py"
INT_MM_LINE = "    return torch._int_mm(lhs, rhs)\n"
ERRORS = [  # (exception message, traceback, fix, models) as users and the simulated device saw them
    ("Expected all tensors to be on the same device, but got weight is on cpu, different from other tensors on cuda:0 "
     "(when checking argument in method wrapper_CUDA___fused_rms_norm)",
     frames(f"{COMFY}/comfy/sd.py", f"{COMFY}/comfy/ldm/minimax/vae.py", "/venv/comfy_kitchen/backends/eager/rope.py"),
     "vae_qk_norm_scale", ("VAE",)),
    (MIXED.format("npu:0"), frames(r"C:\ComfyUI\comfy\ldm\minimax\vae.py", r"C:\venv\comfy_kitchen\__init__.py"),
     "vae_qk_norm_scale", ("VAE",)),
    (MIXED.format("cuda:0"), frames(f"{COMFY}/comfy/ldm/flux/layers.py", "/venv/comfy_kitchen/backends/eager/rope.py"),
     "ck_rope_device", ()),
    (MIXED.format("cuda:0"), frames("/venv/transformers/generation/utils.py",
                                     "/venv/transformers/models/qwen3_vl/modeling_qwen3_vl.py") +
     "    hidden_states = hidden_states + pos_embeds\n", "transformers_qwen3vl_pos_embed", ()),
    (MIXED.format("neuron:0"), frames("/venv/transformers/generation/utils.py",
                                       "/venv/transformers/integrations/sdpa_attention.py"),
     "transformers_static_cache", ()),
    ("Incompatible shapes for broadcasting: (1, 8, 512, 128) and requested shape (1, 4, 512, 128)",
     frames("/venv/transformers/generation/utils.py", "/venv/transformers/cache_utils.py"),
     "transformers_static_cache", ()),
    (INT8, frames(f"{COMFY}/comfy/sd.py", f"{COMFY}/comfy/ldm/minimax/vae.py", f"{COMFY}/comfy/ops.py"),
     "int8_full_precision_mm", ("VAE",)),
    (INT8, frames(f"{COMFY}/comfy/sd.py", f"{COMFY}/comfy/text_encoders/qwen35.py", f"{COMFY}/comfy/ops.py"),
     "int8_full_precision_mm", ("CLIP",)),
    (INT8, frames(f"{COMFY}/comfy/samplers.py", f"{COMFY}/comfy/ldm/minimax/model.py", f"{COMFY}/comfy/ops.py"),
     "int8_full_precision_mm", ("MODEL",)),
    (VOLTA_INT_MM, frames(f"{COMFY}/comfy/sd.py", f"{COMFY}/comfy/ldm/minimax/vae.py", EAGER_INT8) + INT_MM_LINE,
     "int8_full_precision_mm", ("VAE",)),
    (VOLTA_INT_MM, frames(f"{COMFY}/comfy/ldm/minimax/model.py", f"{COMFY}/comfy/ops.py", EAGER_INT8) + INT_MM_LINE,
     "int8_full_precision_mm", ("MODEL",)),
    ("Expected a cuda device, but got: cpu", frames("/venv/comfy_kitchen/flash_attention.py",
                                                   "/venv/torch/cuda/__init__.py"), "cpu_device_cuda_query", ()),
    ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned.",
     frames(f"{COMFY}/custom_nodes/ComfyUI-GGUF/dequant.py"), "music3_graph_capture", ("CLIP",)),
]


@pytest.mark.parametrize("message,traceback,fix,models", ERRORS, ids=[f"{e[2]}{e[3]}" for e in ERRORS])
def test_the_matcher_names_the_fix_of_each_known_error(message, traceback, fix, models):
    found = known_error(message, traceback)
    assert (found.fix, found.models) == (fix, models)


@pytest.mark.parametrize("message,traceback", [
    # the mixed-device message from code no fix covers: ComfyUI's own attention, a third-party node
    (MIXED.format("cuda:0"), frames(f"{COMFY}/comfy/ldm/modules/attention.py")),
    (MIXED.format("cuda:0"), ""),
    ("Incompatible shapes for broadcasting: (1, 8) and requested shape (1, 4)", frames("/venv/torch/functional.py")),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", frames(f"{COMFY}/comfy/ldm/minimax/vae.py")),
    # cuBLASLt refusing a GEMM that is no int8 one (a per-row scaled fp8 GEMM on Blackwell, pytorch/pytorch#192707)
    ("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmulAlgoGetHeuristic(...)",
     frames(f"{COMFY}/comfy/ops.py", "/venv/comfy_kitchen/backends/cuda/fp8.py") + "    torch._scaled_mm(a, b)\n"),
    ("", ""),
])
def test_an_error_no_fix_repairs_matches_nothing(message, traceback):
    assert known_error(message, traceback) is None


def stock_h3() -> dict:
    workflow = load(ROOT / "workflows" / "MiniMax H3 text to video.json")
    swap_loaders.swap(workflow, reverse=True)
    return ui_to_api(workflow, SPECS)


def node_of(prompt: dict, class_type: str) -> str:
    (found,) = [key for key, node in prompt.items() if node["class_type"] == class_type]
    return found


def failed_at(prompt: dict, class_type: str, message: str, traceback: str) -> dict:
    return {"node_id": node_of(prompt, class_type), "node_type": class_type, "exception_message": message,
            "exception_type": "RuntimeError", "traceback": traceback.splitlines(keepends=True)}


VAE_ERROR = (MIXED.format("npu:0"), frames(f"{COMFY}/comfy/ldm/minimax/vae.py"))


class NeededFix(Fix):
    def __init__(self, fix_id: str, targets, state: State = State.NEEDED):
        self.id, self.targets, self.state = fix_id, targets, state

    def detect(self):
        return Status(self.state, f"test stand-in for {self.id}")


@pytest.fixture
def needed(registry):
    """The registry holding stand-ins of the fixes these tests name, each "needed"."""
    return registry(NeededFix("vae_qk_norm_scale", (Target.VAE,)), NeededFix("ck_rope_device", (Target.PROCESS,)),
                    NeededFix("music3_graph_capture", (Target.CLIP,)),
                    NeededFix("int8_full_precision_mm", (Target.MODEL, Target.CLIP, Target.VAE)))


def said(prompt: dict, error: dict) -> dict | None:
    return explain(error, prompt, output_types, swap_loaders.STOCK_TO_PACK, APPLY_NODE)


def test_a_stock_loader_behind_the_failing_node_is_fixed_by_the_swap(needed):
    prompt = stock_h3()
    reply = said(prompt, failed_at(prompt, "VAEDecode", *VAE_ERROR))
    assert (reply["action"], reply["fix"], reply["node"]) == ("fix_workflow", "vae_qk_norm_scale", None)
    assert reply["text"].startswith("A known bug (vae_qk_norm_scale): MiniMax H3's video VAE") and "VAE" in reply["text"]


def test_the_model_through_the_pack_reports_the_fix_state_and_the_doctor(needed):
    prompt = ui_to_api(load(ROOT / "workflows" / "MiniMax H3 text to video.json"), SPECS)
    reply = said(prompt, failed_at(prompt, "VAEDecode", *VAE_ERROR))
    assert reply["action"] == "report"
    assert "vae_qk_norm_scale repairs it; here it is needed (test stand-in for vae_qk_norm_scale), attached to no " \
           "loaded model" in reply["text"] and "python tools/doctor.py --fix vae_qk_norm_scale" in reply["text"]


def test_only_the_failing_model_counts(needed):
    """VAE Decode fails in a workflow whose VAE goes through the pack but whose diffusion model does not: that model
    is not the failing one (red control: the same error at the sampler, with the diffusion model's message)."""
    prompt = ui_to_api(load(ROOT / "workflows" / "MiniMax H3 text to video.json"), SPECS)
    prompt[node_of(prompt, "MiniMaxHotfixUNETLoader")]["class_type"] = "UNETLoader"
    assert said(prompt, failed_at(prompt, "VAEDecode", *VAE_ERROR))["action"] == "report"
    int8 = failed_at(prompt, "SamplerCustomAdvanced", INT8, frames(f"{COMFY}/comfy/samplers.py"))
    assert said(prompt, int8)["action"] == "fix_workflow"


def test_a_model_from_another_loader_gets_an_apply_node_after_that_loader(needed):
    prompt = ui_to_api(music3_gguf(), SPECS)
    error = failed_at(prompt, "MiniMaxMusic3TextEncode", "Cannot copy between CPU and CUDA tensors during CUDA graph "
                      "capture unless the CPU tensor is pinned.", frames(f"{COMFY}/comfy/text_encoders/llama.py"))
    reply = said(prompt, error)
    assert (reply["action"], reply["node"], reply["apply"]) == (
        "insert_apply", node_of(prompt, "CLIPLoaderGGUFDynamicVRAM"), "MiniMaxHotfixApplyCLIP")
    # the bundled workflow has that Apply node already
    bundled = ui_to_api(load(ROOT / "workflows" / "MiniMax Music 3 with a GGUF text encoder.json"), SPECS)
    assert said(bundled, failed_at(bundled, "MiniMaxMusic3TextEncode", error["exception_message"], ""))["action"] \
        == "report"


def test_a_process_wide_fix_reports_its_state(needed):
    prompt = stock_h3()
    error = failed_at(prompt, "VAEDecode", MIXED.format("cuda:0"), frames("/venv/comfy_kitchen/backends/eager/rope.py"))
    reply = said(prompt, error)
    assert (reply["action"], reply["fix"]) == ("report", "ck_rope_device")
    assert "ck_rope_device repairs it; here it is needed" in reply["text"] and "not installed" in reply["text"]


def test_a_switched_off_fix_says_so_instead_of_offering_the_swap(needed, monkeypatch):
    monkeypatch.setenv("MINIMAX_HOTFIX_DISABLE", "vae_qk_norm_scale")
    prompt = stock_h3()
    reply = said(prompt, failed_at(prompt, "VAEDecode", *VAE_ERROR))
    assert reply["action"] == "report" and "here it is disabled (switched off by MINIMAX_HOTFIX_DISABLE)" in \
        reply["text"] and "Take it out of MINIMAX_HOTFIX_DISABLE" in reply["text"]


def test_a_transformers_model_needs_its_custom_node(needed):
    prompt = stock_h3()
    error = failed_at(prompt, "VAEDecode", MIXED.format("cuda:0"),
                      frames("/venv/transformers/models/qwen3_vl/modeling_qwen3_vl.py") + "    pos_embeds = x\n")
    reply = said(prompt, error)
    assert reply["action"] == "custom_node" and "attach_to_transformers_model(model)" in reply["text"]


def test_an_edited_workflow_judges_the_error_alone(needed):
    """The open workflow no longer has the failing node (or has another type under its id): no loader is named."""
    prompt = stock_h3()
    error = {**failed_at(prompt, "VAEDecode", *VAE_ERROR), "node_type": "VAEDecodeTiled"}
    assert said(prompt, error)["action"] == "fix_workflow"
    assert said(prompt, {**error, "node_id": "999"})["action"] == "fix_workflow"


def test_an_unknown_error_says_nothing(needed):
    prompt = stock_h3()
    assert said(prompt, failed_at(prompt, "VAEDecode", "CUDA out of memory", "")) is None


@pytest.mark.parametrize("case", ["lora between", "checkpoint", "apply after checkpoint"])
def test_model_sources_walks_through_pass_through_nodes_and_stops_at_the_pack(case):
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {}},
              "2": {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1]}},
              "3": {"class_type": "KSampler", "inputs": {"model": ["2", 0]}}}
    if case == "lora between":
        assert api_model_sources(prompt, "3", ("MODEL",), output_types) == ([], ["1"])
    elif case == "checkpoint":
        prompt["4"] = {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["1", 2]}}
        assert api_model_sources(prompt, "4", ("VAE",), output_types) == ([], ["1"])
    else:
        prompt["5"] = {"class_type": "MiniMaxHotfixApplyModel", "inputs": {"model": ["1", 0]}}
        prompt["2"]["inputs"]["model"] = ["5", 0]
        assert api_model_sources(prompt, "3", ("MODEL",), output_types) == (["5"], [])
