"""Test-only ComfyUI custom node, placed in a temporary ComfyUI's custom_nodes by the workflow run tests.

* Makes ComfyUI build the tiny configurations the synthetic model files were written for
  (``synthetic_models.TINY_CONFIGS``, with the changes of the models folder's ``TINY_CONFIGS_FILE``: ComfyUI
  hard-codes those models' sizes) before any loader builds a model.
* ``TestProbeSaveTensors`` writes the tensors of its inputs to the output folder, so that a test compares runs
  bit for bit rather than through lossy encoders.
* ``TestProbeFixedLatent`` gives a latent of the input's shape (the last part of a nested one: MiniMax H3's audio)
  with fixed values, so that a decoder is compared on the same input on every device: the synthetic H3 audio VAE
  amplifies the sampled latent's last-bit differences far beyond any tolerance.
"""

import importlib.util
import os
from pathlib import Path

import folder_paths
import torch
from safetensors.torch import save_file

_spec = importlib.util.spec_from_file_location(
    "minimax_hotfix_test_synthetic_models", Path(__file__).resolve().parents[1] / "synthetic_models.py")
synthetic_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synthetic_models)
for _patcher in synthetic_models.tiny_config_patches(Path(folder_paths.models_dir)):
    _patcher.start()

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


class TestProbeFixedLatent:
    CATEGORY = "testing"
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "fixed"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latent": ("LATENT",)}}

    def fixed(self, latent):
        samples = latent["samples"]
        shape = (samples.unbind()[-1] if samples.is_nested else samples).shape
        return ({"samples": torch.randn(shape, generator=torch.Generator().manual_seed(0))},)


NODE_CLASS_MAPPINGS = {"TestProbeSaveTensors": TestProbeSaveTensors, "TestProbeFixedLatent": TestProbeFixedLatent}
