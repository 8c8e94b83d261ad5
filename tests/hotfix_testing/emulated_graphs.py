"""Music 3's graphed AR path on the CPU, without the pack: comfy-kitchen's CUDA decode kernel replaced by its eager
reference (so ``Llama2_`` builds ``FixedKV`` caches and takes its graphed-decode branch as on a GPU) and
``comfy.model_prefetch.prefetch_queue_pop`` by a per-unit graph emulation with the same gate (the unit's
``_v_block``) and the same warm-up / capture / replay sequence, whose replay re-runs the capture step's ``core`` with
its variables frozen, i.e. reads the tensors (addresses) bound at capture, as a CUDA graph does.

Used in-process by the tests and inside a ComfyUI server by the test probe (tests/comfyui_probe), which a server
without the pack loads too: nothing here imports the pack. Both pass the pack's emulated capture rules
(``diagnostics/emulated_capture.py``) as ``capture_rules``."""

import contextlib
import types

import torch

# set (to 1) in a server's environment: the probe runs that server's Music 3 AR loop on the emulated graphs
EMULATED_GRAPHS_ENV = "MINIMAX_HOTFIX_EMULATED_GRAPHS"


def eager_flash_attention_decode(q, k, v, kv_lengths):
    """What comfy-kitchen's CUDA decode kernel computes: q (b, 1, hq, d) over the first kv_lengths cache slots."""
    groups = q.shape[2] // k.shape[2]
    filled = torch.arange(k.shape[1], device=k.device)[None, :] < kv_lengths[:, None]
    # slots past kv_lengths are never read (the cache is torch.empty): zero them instead of multiplying garbage by 0
    k, v = (t.masked_fill(~filled[:, :, None, None], 0).repeat_interleave(groups, dim=2).float() for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~filled[:, None, None, :], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).to(q.dtype)


class EmulatedPrefetch:
    """``prefetch_queue_pop`` for CPU: same gate and warm-up / capture / replay as the real one (no queues on CPU);
    ``capture_rules()`` is the context a capture runs in (what CUDA refuses during capture)."""

    def __init__(self, capture_rules=contextlib.nullcontext):
        self.enabled = True  # False: as with --disable-cuda-graphs
        self.graphs = {}
        self.warmed = set()
        self.capture_rules = capture_rules

    def __call__(self, queue, device, module, dtype=None, core=None, enable_graph=False, generator=None, **_):
        if core is None:
            return
        if not (self.enabled and enable_graph and getattr(module, "_v_block", None) is not None):
            core()
        elif module in self.graphs:
            self.graphs[module]()
        elif module in self.warmed:
            # A graph keeps the addresses core() touched now; a closure called later would see the forward's loop
            # variables as they are then, so the capture keeps core() with its variables frozen at this step.
            frozen = types.FunctionType(core.__code__, core.__globals__, core.__name__, core.__defaults__,
                                        tuple(types.CellType(cell.cell_contents) for cell in core.__closure__))
            with self.capture_rules():
                frozen()
            self.graphs[module] = frozen
        else:
            core()
            self.warmed.add(module)

    def reset(self) -> None:
        """What ComfyUI's ``cleanup_prefetch_queues`` does after each node: every graph and warm-up dropped."""
        self.graphs.clear()
        self.warmed.clear()


@contextlib.contextmanager
def emulated_graph_path(prefetch, capture_rules=contextlib.nullcontext):
    """The graphed path on the CPU in ``prefetch`` (the core's ``comfy.model_prefetch``); yields the emulation; all
    put back afterwards."""
    import comfy_kitchen

    emulation = EmulatedPrefetch(capture_rules)
    replaced = [(comfy_kitchen, "flash_attention_decode_is_available", lambda device: True),
                (comfy_kitchen, "flash_attention_decode", eager_flash_attention_decode),
                (prefetch, "prefetch_queue_pop", emulation)]
    if hasattr(prefetch, "malloc_graph_enabled"):
        # a core with the Comfy Compiler's graph-scoped allocation (#16428's AR loop passes its decode buffers only
        # when it is on): on for as long as the emulated graphs are, as on a CUDA machine with comfy-aimdo
        replaced.append((prefetch, "malloc_graph_enabled", lambda device: emulation.enabled))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
    for owner, name, value in replaced:
        setattr(owner, name, value)
    try:
        yield emulation
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)
