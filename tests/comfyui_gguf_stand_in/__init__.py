"""Stand-in for ComfyUI-GGUF's loaders, which the test ComfyUI lacks: ``CLIPLoaderGGUFDynamicVRAM`` loads a ``.gguf``
text encoder from ``models/text_encoders`` the way ComfyUI-GGUF's does: every quantized tensor a "GGMLLayout"
``QuantizedTensor`` dequantized on each call as ComfyUI-GGUF dequantizes it (tests/hotfix_testing/ggml_layout.py),
into ``comfy.sd.load_text_encoder_state_dicts`` under dynamic VRAM, and it refuses a server without dynamic VRAM, as
ComfyUI-GGUF's does. ``UnetLoaderGGUF`` (ComfyUI-GGUF's diffusion-model loader: ``unet_name`` from the ``.gguf`` files
of ``models/diffusion_models``, listed under "unet_gguf"; one MODEL out) loads the same "GGMLLayout" tensors into
``comfy.sd.load_diffusion_model_state_dict``, which builds ComfyUI's own patcher for the server's memory manager
(dynamic VRAM or the legacy loader), as ComfyUI-GGUF's Dynamic VRAM loader hands its tensors to ComfyUI; under the
legacy loader through ``GGMLOps``, which keep each quantized weight and dequantize it per call, as ComfyUI-GGUF's do.
What it leaves out: LoRA handling, progress bars, ComfyUI-GGUF's ``GGMLTensor`` and ``GGUFModelPatcher`` (the
"GGMLLayout" tensors instead, ComfyUI's own patcher), and every GGML type but Q4_0, Q8_0 and the plain ones.
``CLIPLoaderGGUF``, ComfyUI-GGUF's legacy node, has its inputs and title for validation only."""

import importlib
import importlib.util
import sys
from pathlib import Path

import comfy.memory_management
import comfy.model_management
import comfy.ops
import comfy.sd
import folder_paths
import torch

import nodes

# ComfyUI-GGUF lists .gguf files of the text encoder and diffusion model folders under keys of its own
folder_paths.folder_names_and_paths["clip_gguf"] = (folder_paths.get_folder_paths("text_encoders"), {".gguf"})
folder_paths.folder_names_and_paths["unet_gguf"] = (folder_paths.get_folder_paths("diffusion_models"), {".gguf"})


def _testing_module(name: str):
    """tests/hotfix_testing/NAME.py, its relative imports resolved (the server's path holds ComfyUI, not the tests)."""
    package = "minimax_hotfix_testing"
    if package not in sys.modules:
        folder = Path(__file__).resolve().parents[1] / "hotfix_testing"
        spec = importlib.util.spec_from_file_location(package, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        sys.modules[package] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[package])
    return importlib.import_module(f"{package}.{name}")


ggml_layout = _testing_module("ggml_layout")


class CLIPLoaderGGUFDynamicVRAM:
    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load_clip"
    CATEGORY = "bootleg"
    TITLE = "CLIPLoader (GGUF, Dynamic VRAM)"

    @classmethod
    def INPUT_TYPES(cls):
        files = sorted(folder_paths.get_filename_list("text_encoders") + folder_paths.get_filename_list("clip_gguf"))
        return {"required": {"clip_name": (files,), "type": nodes.CLIPLoader.INPUT_TYPES()["required"]["type"]}}

    def load_clip(self, clip_name, type="stable_diffusion"):
        if not comfy.memory_management.aimdo_enabled:
            raise RuntimeError("Dynamic VRAM is not enabled in this ComfyUI installation. Start ComfyUI without "
                               "--disable-dynamic-vram and use a build that supports DynamicVRAM.")
        state = ggml_layout.gguf_state_dict(folder_paths.get_full_path_or_raise("text_encoders", clip_name))
        clip = comfy.sd.load_text_encoder_state_dicts(
            state_dicts=[state], clip_type=getattr(comfy.sd.CLIPType, type.upper(), comfy.sd.CLIPType.STABLE_DIFFUSION),
            embedding_directory=folder_paths.get_folder_paths("embeddings"),
            model_options={"initial_device": comfy.model_management.text_encoder_offload_device()})
        return (clip,)


class CLIPLoaderGGUF(CLIPLoaderGGUFDynamicVRAM):
    TITLE = "CLIPLoader (GGUF, Legacy node)"

    def load_clip(self, clip_name, type="stable_diffusion"):
        raise RuntimeError("stand-in for ComfyUI-GGUF's legacy CLIPLoaderGGUF: its inputs, for validation only")


class GGMLOps(comfy.ops.manual_cast):
    """ComfyUI-GGUF's ops of the legacy loader (``ops.GGMLOps``), as far as the tests' DiT needs them: each Linear takes
    the quantized weight the file gave it as its parameter (``GGMLLayer._load_from_state_dict``) and ComfyUI's cast
    dequantizes it on every call, where ComfyUI's own legacy load would copy it into a dense parameter and fail."""

    class Linear(comfy.ops.manual_cast.Linear):
        def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                  error_msgs):
            for name in ("weight", "bias"):
                if prefix + name in state_dict:
                    setattr(self, name, torch.nn.Parameter(state_dict[prefix + name], requires_grad=False))
                elif getattr(self, name) is not None:
                    missing_keys.append(prefix + name)


class UnetLoaderGGUF:
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load_unet"
    CATEGORY = "bootleg"
    TITLE = "Unet Loader (GGUF)"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"unet_name": (folder_paths.get_filename_list("unet_gguf"),)}}

    def load_unet(self, unet_name):
        path = folder_paths.get_full_path_or_raise("unet_gguf", unet_name)
        # under dynamic VRAM ComfyUI's own ops take the quantized weights as they are; float16: what ComfyUI-GGUF's
        # "GGMLLayout" tensors dequantize to (quant_ops.make_quantized's default)
        options = {} if comfy.memory_management.aimdo_enabled else {"custom_operations": GGMLOps}
        model = comfy.sd.load_diffusion_model_state_dict(ggml_layout.gguf_state_dict(path, torch.float16), options)
        if model is None:
            raise RuntimeError(f"ERROR: Could not detect model type of: {path}")
        return (model,)


NODE_CLASS_MAPPINGS = {"CLIPLoaderGGUF": CLIPLoaderGGUF, "CLIPLoaderGGUFDynamicVRAM": CLIPLoaderGGUFDynamicVRAM,
                       "UnetLoaderGGUF": UnetLoaderGGUF}
NODE_DISPLAY_NAME_MAPPINGS = {name: node.TITLE for name, node in NODE_CLASS_MAPPINGS.items()}
