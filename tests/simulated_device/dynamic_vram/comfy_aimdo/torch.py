"""comfy_aimdo.torch: tensors over the stand-in's slots and cast buffers."""


def aimdo_to_tensor(alloc, device):
    owner, offset, size = alloc
    return owner.tensor(offset, size)


def hostbuf_to_tensor(hostbuf):
    raise NotImplementedError("pinned host memory is off with the simulated device's comfy-aimdo")


def get_torch_allocator():
    return None
