"""A stand-in comfy-aimdo for the simulated accelerator (test-only): ComfyUI's dynamic VRAM loader
(``ModelPatcherDynamic``) runs on ``npu:N`` with real values.

The real comfy-aimdo is a native library over the CUDA driver: a "vbar" per model reserves VRAM address space, and
``vbar_fault`` maps a weight's pages in (or answers "out of VRAM", and ComfyUI streams that weight through a cast
buffer instead). Here a vbar keeps each staged weight (each ``alloc``) resident as a device tensor while the simulated
device has room for it, evicts other models' weights to make room, and answers "out of VRAM" past that; a page is one
``alloc`` (the real library's pages are 32 MB, larger than the tiny test models' weights).

What it cannot show: the native allocator and its fragmentation, page faults' timing, the CUDA streams ComfyUI would
overlap copies on (the simulated device has no offload stream), pinned host memory (off: ``--disable-pinned-memory``;
``HostBuffer`` refuses to grow), direct file-to-device reads (``ModelMMAP`` gives no file handle, so ComfyUI copies
from the memory map).

The harness puts the folder above this package on the server's ``PYTHONPATH`` ahead of site-packages, for servers
started with ``SimulatedDevice(dynamic_vram=True)`` (tests/hotfix_testing/comfyui_server.py).
"""

__version__ = "0.4.13+simulated"
