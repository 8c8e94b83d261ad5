"""comfy_aimdo.model_mmap: a safetensors file mapped copy-on-write (ComfyUI reads tensors from the address); no file
handle, so ComfyUI never asks for a direct file-to-device read."""

import ctypes
import mmap


class ModelMMAP:
    def __init__(self, filepath):
        with open(filepath, "rb") as file:
            self.map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        self.anchor = ctypes.c_char.from_buffer(self.map)

    def get(self) -> int:
        return ctypes.addressof(self.anchor)

    def get_file_handle(self):
        return None

    def bounce(self):
        pass
