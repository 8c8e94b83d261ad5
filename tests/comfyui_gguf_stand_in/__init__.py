"""Stand-in for ComfyUI-GGUF's text encoder loaders, which the test ComfyUI lacks: ``CLIPLoaderGGUF`` (its legacy node)
and ``CLIPLoaderGGUFDynamicVRAM``, with their inputs and titles. They load a ``.gguf`` text encoder from
``models/text_encoders`` the way ComfyUI-GGUF's Dynamic VRAM loader hands it to ComfyUI: every quantized tensor a
"GGMLLayout" ``QuantizedTensor`` dequantized on each call as ComfyUI-GGUF dequantizes it
(tests/hotfix_testing/ggml_layout.py), into ``comfy.sd.load_text_encoder_state_dicts``; the Dynamic VRAM node refuses
a server without dynamic VRAM, as ComfyUI-GGUF's does. What it leaves out: the legacy node's ``GGMLOps`` and
``GGUFModelPatcher``, which dequantize on every call on a legacy patcher (no CUDA-graph unit either way): it
dequantizes once at load instead, the same numbers; LoRA handling, progress bars, and every GGML type but Q4_0 and
the plain ones."""

import importlib
import importlib.util
import sys
from pathlib import Path

import comfy.memory_management
import comfy.model_management
import comfy.sd
import comfy.utils
import folder_paths
from comfy_kitchen.tensor import QuantizedTensor

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


class CLIPLoaderGGUF:
    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load_clip"
    CATEGORY = "bootleg"
    TITLE = "CLIPLoader (GGUF, Legacy node)"
    DYNAMIC_VRAM = False

    @classmethod
    def INPUT_TYPES(cls):
        files = sorted(folder_paths.get_filename_list("text_encoders") + folder_paths.get_filename_list("clip_gguf"))
        return {"required": {"clip_name": (files,), "type": nodes.CLIPLoader.INPUT_TYPES()["required"]["type"]}}

    def load_clip(self, clip_name, type="stable_diffusion"):
        if self.DYNAMIC_VRAM and not comfy.memory_management.aimdo_enabled:
            raise RuntimeError("Dynamic VRAM is not enabled in this ComfyUI installation. Start ComfyUI without "
                               "--disable-dynamic-vram and use a build that supports DynamicVRAM.")
        path = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
        clip_type = getattr(comfy.sd.CLIPType, type.upper(), comfy.sd.CLIPType.STABLE_DIFFUSION)
        state = ggml_layout.gguf_state_dict(path) if path.endswith(".gguf") else comfy.utils.load_torch_file(path)
        if not self.DYNAMIC_VRAM:
            state = {key: value.dequantize() if isinstance(value, QuantizedTensor) else value
                     for key, value in state.items()}
        clip = comfy.sd.load_text_encoder_state_dicts(
            state_dicts=[state], clip_type=clip_type, embedding_directory=folder_paths.get_folder_paths("embeddings"),
            model_options={"initial_device": comfy.model_management.text_encoder_offload_device()},
            disable_dynamic=not self.DYNAMIC_VRAM)
        return (clip,)


class CLIPLoaderGGUFDynamicVRAM(CLIPLoaderGGUF):
    TITLE = "CLIPLoader (GGUF, Dynamic VRAM)"
    DYNAMIC_VRAM = True


NODE_CLASS_MAPPINGS = {"CLIPLoaderGGUF": CLIPLoaderGGUF, "CLIPLoaderGGUFDynamicVRAM": CLIPLoaderGGUFDynamicVRAM}
NODE_DISPLAY_NAME_MAPPINGS = {name: node.TITLE for name, node in NODE_CLASS_MAPPINGS.items()}
