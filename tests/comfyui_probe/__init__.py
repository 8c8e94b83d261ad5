"""Test-only ComfyUI custom node, placed in a temporary ComfyUI's custom_nodes by the workflow run tests.

* Applies the tiny MiniMax Music 3 text encoder configuration named in MINIMAX_HOTFIX_TEST_MUSIC3_TEXT_ENCODER
  (ComfyUI hard-codes a 10 B parameter one) before any loader builds the model.
* ``TestProbeSaveTensors`` writes the tensors of its inputs to the output folder, so that a test compares runs
  bit for bit rather than through lossy encoders.
"""

import json
import os

import torch
from safetensors.torch import save_file

import folder_paths
from comfy.text_encoders import minimax_music

if os.environ.get("MINIMAX_HOTFIX_TEST_MUSIC3_TEXT_ENCODER"):
    minimax_music.MODEL_CONFIG.update(json.loads(os.environ["MINIMAX_HOTFIX_TEST_MUSIC3_TEXT_ENCODER"]))


class TestProbeSaveTensors:
    CATEGORY = "testing"
    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"filename": ("STRING", {"default": "probe"})},
                "optional": {"conditioning": ("CONDITIONING",), "latent": ("LATENT",), "audio": ("AUDIO",),
                             "sigmas": ("SIGMAS",)}}

    def save(self, filename, conditioning=None, latent=None, audio=None, sigmas=None):
        tensors = {}
        if conditioning is not None:
            tensors["conditioning"] = conditioning[0][0]
        if latent is not None:
            tensors["latent"] = latent["samples"]
        if audio is not None:
            tensors["audio"] = audio["waveform"]
        os.makedirs(folder_paths.get_output_directory(), exist_ok=True)
        if sigmas is not None:
            tensors["sigmas"] = sigmas
        path = os.path.join(folder_paths.get_output_directory(), f"{filename}.safetensors")
        save_file({name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in tensors.items()},
                  path)
        return {"ui": {"probe": [{"filename": os.path.basename(path)}]}}


NODE_CLASS_MAPPINGS = {"TestProbeSaveTensors": TestProbeSaveTensors}
