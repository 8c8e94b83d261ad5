"""Test-only ComfyUI custom node, placed in a temporary ComfyUI's custom_nodes by the workflow run tests.

* Makes ComfyUI build the tiny configurations the synthetic model files were written for
  (``synthetic_models.TINY_CONFIGS``: ComfyUI hard-codes those models' sizes) before any loader builds a model.
* ``TestProbeMiniMaxH3TextEncoder`` stands in for the MiniMax H3 text encoder (a Qwen3-VL-32B hard-coded in ComfyUI,
  far beyond a CPU): a CLIP whose ``tokenize`` and ``encode_from_tokens_scheduled`` give what the H3 conditioning
  nodes read from the real one, hidden states of the DiT's text width and per-token modality tags (0 over each
  vision block, 1 over text), as fixed-seed values.
* ``TestProbeSaveTensors`` writes the tensors of its inputs to the output folder, so that a test compares runs
  bit for bit rather than through lossy encoders.
"""

import importlib.util
import os
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

import folder_paths

_spec = importlib.util.spec_from_file_location(
    "minimax_hotfix_test_synthetic_models", Path(__file__).resolve().parents[1] / "synthetic_models.py")
synthetic_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synthetic_models)
for _patcher in synthetic_models.tiny_config_patches():
    _patcher.start()

VISION_BLOCK_TOKENS = 6  # stands for <|vision_start|>, the merged patches and <|vision_end|> of one image or frame pair


class StandInH3TextEncoder:
    """The two CLIP methods MiniMaxH3ImageToVideo and MiniMaxH3ReferenceToVideo call."""

    def __init__(self, text_dim):
        self.text_dim = text_dim

    def tokenize(self, text, images=(), minimax_ref_items=None, **kwargs):
        vision_blocks = len(images) + sum(item["type"] in ("image", "video") for item in minimax_ref_items or ())
        labels = len(images) + len(minimax_ref_items or ())
        return {"text": text, "vision_blocks": vision_blocks, "labels": labels}

    def encode_from_tokens_scheduled(self, tokens):
        tags = torch.cat([torch.ones(2 * tokens["labels"], dtype=torch.long),
                          torch.zeros(VISION_BLOCK_TOKENS * tokens["vision_blocks"], dtype=torch.long),
                          torch.ones(len(tokens["text"].split()), dtype=torch.long)])
        generator = torch.Generator().manual_seed(zlib.crc32(tokens["text"].encode()))
        hidden = torch.randn(1, tags.shape[0], self.text_dim, generator=generator)
        return [[hidden, {"pooled_output": None, "minimax_token_tags": tags}]]


class TestProbeMiniMaxH3TextEncoder:
    CATEGORY = "testing"
    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text_dim": ("INT", {"default": 64, "min": 1, "max": 8192})}}

    def load(self, text_dim):
        return (StandInH3TextEncoder(text_dim),)


class TestProbeSaveTensors:
    CATEGORY = "testing"
    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"filename": ("STRING", {"default": "probe"})},
                "optional": {"conditioning": ("CONDITIONING",), "latent": ("LATENT",), "audio": ("AUDIO",),
                             "sigmas": ("SIGMAS",), "images": ("IMAGE",)}}

    def save(self, filename, conditioning=None, latent=None, audio=None, sigmas=None, images=None):
        tensors = {}
        if conditioning is not None:
            tensors["conditioning"] = conditioning[0][0]
        if latent is not None:
            samples = latent["samples"]
            if samples.is_nested:  # MiniMax H3: (video, audio)
                tensors.update({f"latent_{index}": part for index, part in enumerate(samples.unbind())})
            else:
                tensors["latent"] = samples
        if audio is not None:
            tensors["audio"] = audio["waveform"]
        if sigmas is not None:
            tensors["sigmas"] = sigmas
        if images is not None:
            tensors["images"] = images
        os.makedirs(folder_paths.get_output_directory(), exist_ok=True)
        path = os.path.join(folder_paths.get_output_directory(), f"{filename}.safetensors")
        save_file({name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in tensors.items()},
                  path)
        return {"ui": {"probe": [{"filename": os.path.basename(path)}]}}


NODE_CLASS_MAPPINGS = {"TestProbeSaveTensors": TestProbeSaveTensors,
                       "TestProbeMiniMaxH3TextEncoder": TestProbeMiniMaxH3TextEncoder}
