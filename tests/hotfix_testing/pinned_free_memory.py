"""A CUDA server's free-memory reading as if it were alone on its GPU, for the GPU check's servers side by side.

ComfyUI reads free memory with ``torch.cuda.mem_get_info``, the whole device's: a second server on the same GPU
loading its models would shrink this one's partial loads, and the check's smallest budgets leave 1.5 MB. With
PINNED_FREE_MEMORY_ENV set, the test probe replaces that reading with ``pinned``'s: the device's free bytes at the
first reading plus what this process's allocator held then, less what it holds now. Only this process's allocations
move it, and ComfyUI still decides every partial load from it. Loaded by the test probe from its file: stdlib only.
"""

import os

PINNED_FREE_MEMORY_ENV = "MINIMAX_HOTFIX_TEST_PINNED_FREE_MEMORY"


def pinned(mem_get_info, memory_reserved, index_of):
    """A ``mem_get_info(device=None) -> (free, total)`` over the real one, ``memory_reserved(index)`` (this process's
    allocator) and ``index_of(device)`` (a device argument as a device index)."""
    baselines = {}

    def reading(device=None):
        index = index_of(device)
        if index not in baselines:
            free, total = mem_get_info(index)
            baselines[index] = free + memory_reserved(index), total
        baseline, total = baselines[index]
        return max(baseline - memory_reserved(index), 0), total

    return reading


def pin_where_asked(cuda, environ=os.environ) -> bool:
    """Replaces ``cuda.mem_get_info`` (``cuda``: ``torch.cuda``) by ``pinned``'s reading where the server's
    environment sets PINNED_FREE_MEMORY_ENV (the test probe's call at start-up); whether it did."""
    if environ.get(PINNED_FREE_MEMORY_ENV) != "1":
        return False
    cuda.mem_get_info = pinned(cuda.mem_get_info, cuda.memory_reserved,
                               lambda device: cuda._utils._get_device_index(device, optional=True))
    return True
