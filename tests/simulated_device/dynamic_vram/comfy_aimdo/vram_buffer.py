"""comfy_aimdo.vram_buffer: a cast buffer that grows on the simulated device."""

import torch


class VRAMBuffer:
    def __init__(self, max_size, device):
        self.device, self.max_size = device, max_size
        self.storage = torch.empty(0, dtype=torch.uint8, device=f"npu:{device}")

    def size(self) -> int:
        return self.storage.numel()

    def get(self, size, offset=0):
        offset, size = int(offset), int(size)
        if offset + size > self.storage.numel():
            grown = torch.empty(offset + size, dtype=torch.uint8, device=self.storage.device)
            grown[:self.storage.numel()].copy_(self.storage)
            self.storage = grown
        return (self, offset, size)

    def tensor(self, offset, size):
        return self.storage[offset:offset + size]
