"""Stand-in for ComfyUI-GGUF's text encoder loaders, which the test ComfyUI lacks: ``CLIPLoaderGGUFDynamicVRAM`` loads
a ``.gguf`` text encoder from ``models/text_encoders`` the way ComfyUI-GGUF's does: every quantized tensor a
"GGMLLayout" ``QuantizedTensor`` dequantized on each call as ComfyUI-GGUF dequantizes it
(tests/hotfix_testing/ggml_layout.py), into ``comfy.sd.load_text_encoder_state_dicts`` under dynamic VRAM, and it
refuses a server without dynamic VRAM, as ComfyUI-GGUF's does. What it leaves out: LoRA handling, progress bars, and
every GGML type but Q4_0 and the plain ones. ``CLIPLoaderGGUF``, ComfyUI-GGUF's legacy node, has its inputs and
title for validation only."""

import importlib
import importlib.util
import sys
from pathlib import Path

import comfy.memory_management
import comfy.model_management
import comfy.sd
import folder_paths

import nodes

# ComfyUI-GGUF lists .gguf files of the text encoder folders under a key of its own
folder_paths.folder_names_and_paths["clip_gguf"] = (folder_paths.get_folder_paths("text_encoders"), {".gguf"})


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


NODE_CLASS_MAPPINGS = {"CLIPLoaderGGUF": CLIPLoaderGGUF, "CLIPLoaderGGUFDynamicVRAM": CLIPLoaderGGUFDynamicVRAM}
NODE_DISPLAY_NAME_MAPPINGS = {name: node.TITLE for name, node in NODE_CLASS_MAPPINGS.items()}
