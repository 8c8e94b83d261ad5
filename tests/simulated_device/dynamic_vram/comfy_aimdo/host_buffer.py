"""comfy_aimdo.host_buffer: pinned host memory, which the simulated device's servers run without
(``--disable-pinned-memory``). ComfyUI still builds empty buffers for its pin bookkeeping; growing one is refused."""


class HostBuffer:
    def __init__(self, size, prewarm=0, max_grow_size=0, mark_cold=True):
        if size:
            raise NotImplementedError("pinned host memory is off with the simulated device's comfy-aimdo")
        self.size = 0

    def get_raw_address(self):
        raise NotImplementedError("pinned host memory is off with the simulated device's comfy-aimdo")

    def extend(self, size, reallocate=False, register=True):
        raise NotImplementedError("pinned host memory is off with the simulated device's comfy-aimdo")

    def read_file_slice(self, file_obj, file_offset, size, offset=0, stream=0, device_ptr=0, device=-1):
        raise NotImplementedError("no direct file reads into pinned memory with the simulated device's comfy-aimdo")

    def register(self, offset, size):
        pass

    def unregister(self, offset):
        pass

    def truncate(self, size, do_unregister=True):
        self.size = min(self.size, size)


def read_file_to_device(file_obj, file_offset, size, stream, device_ptr, device, mark_cold=True):
    raise NotImplementedError("no direct file-to-device reads with the simulated device's comfy-aimdo")


def cleanup_file_reader():
    pass
