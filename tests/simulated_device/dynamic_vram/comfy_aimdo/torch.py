"""comfy_aimdo.torch: tensors over the stand-in's slots and cast buffers."""


def get_tensor_from_raw_ptr(ptr, size, device):
    raise NotImplementedError("raw device pointers: the simulated device's memory is torch tensors, not addresses")


class CUDAPluggableAllocator:
    """The real one hands the native allocator to torch's CUDA caching allocator; the simulated device has neither."""

    def __init__(self):
        raise NotImplementedError("no CUDA allocator on the simulated device")


def aimdo_to_tensor(alloc, device):
    owner, offset, size = alloc
    return owner.tensor(offset, size)


def hostbuf_to_tensor(hostbuf):
    raise NotImplementedError("pinned host memory is off with the simulated device's comfy-aimdo")


def get_torch_allocator():
    return None
