"""cpu_device_cuda_query: a text encoder that ComfyUI puts on the CPU of an NVIDIA machine runs there.

Bug: ComfyUI keeps the text encoder on the CPU where ``text_encoder_device()`` says so: where it runs it without fp16
(``should_use_fp16`` is false on GTX 16xx cards, with ``--force-fp32``), with ``--novram``, and in low-VRAM states
without dynamic VRAM. Capability queries asked about that CPU device then go to CUDA, which refuses a CPU device:
ValueError: Expected a cuda device, but got: cpu
* ComfyUI 0.33.0, MiniMax Music 3 (``MiniMaxMusic3TextEncode``): ``MiniMaxMusic3AR.generate`` ->
  ``Llama2_.init_kv_cache(..., device)`` -> ``comfy_kitchen.flash_attention_decode_is_available(cpu)`` ->
  ``torch.cuda.get_device_capability(cpu)`` (comfy-kitchen 0.2.31 asks CUDA before looking at the device type).
* Newer cores, any text encoder's ``CLIP.generate`` (the MiniMax H3 encoder's prompt enhancing):
  ``comfy.ops.use_quantized_matmul(model, cpu)`` -> ``get_disabled_quant_formats`` -> ``supports_nvfp4_compute``
  (then ``supports_mxfp8_compute``, ``supports_fp8_compute``) -> ``torch.cuda.get_device_properties(cpu)``: after
  ``is_nvidia()`` they never look at the device.

Upstream: Comfy-Org/ComfyUI #15607 (Music 3 on a GTX 1660 SUPER, 0.33.0, open) and #16365 (``CLIP.generate`` on a
GTX 1650, open); PR #16374 puts the text encoder on the GPU under dynamic VRAM only, so the CPU placement stays
without it (``--novram``, ``--disable-dynamic-vram``, no working comfy-aimdo). comfy-kitchen #131 (open) is the
kitchen half: comfy-kitchen 0.2.40 answers False for a non-CUDA device, 0.2.31 (pinned by 0.33.0) does not.
``supports_nvfp4_compute`` is unchanged at 0.38.0.

Applies to: ComfyUI 0.33.0 to 0.39 on NVIDIA machines (any machine's install can carry the bug; only an NVIDIA one
shows it).

Detection (behaviour, the same on every machine): each query is run as on an NVIDIA machine (a copy of it whose module
sees ``is_nvidia()`` true and a ``torch.cuda`` that refuses every device lookup as torch refuses a CPU device) and asked
about the CPU. Those that reach CUDA are needed; when none does, "fixed upstream". Each needed query must also answer
for the CPU as on a machine without CUDA, and take ``device`` first, or the fix reads "failed" (target drifted). Any
other ``supports_*`` query of ``comfy.model_management`` that behaves the same (a query a newer core added or
renamed) is found by that behaviour and guarded too.

Retires: when every supported core's queries answer for a CPU device without asking CUDA (this fix then reads
"fixed upstream" everywhere): delete this file, its kernels/ file, self-test, test and doc, and its README entries.

Off switch: ``MINIMAX_HOTFIX_DISABLE=cpu_device_cuda_query`` (read when ComfyUI loads the pack).

How: process-wide, idempotent and reversible, because no per-model hook runs between the patcher's load device and
these module functions (``CLIP.generate`` asks before the model runs; ``init_kv_cache`` looks the kitchen function up
in kitchen's module). Each needed query is wrapped in its module: a CUDA device (or ``None``, the current one) goes to
the query as it is, so the GPU models of the workflow are untouched; any other device gets the query's answer as on a
machine without CUDA, which is what an all-CPU run of ComfyUI gets: no flash decode, NVFP4, MXFP8 or FP8 matmul on the
CPU (unless ``--supports-fp8-compute``), so the encoder's quantized layers take their CPU path and its output equals
an all-CPU run's.
"""

from __future__ import annotations

import inspect
import threading

from ..contract import Fix, Retirement, State, Status, Target, log
from ..kernels.cpu_device_cuda_query import asks_cuda_about_the_cpu, guarded, unguarded

FIX_ID = "cpu_device_cuda_query"
# where ComfyUI asks about its text encoder's load device: Llama2_.init_kv_cache (Music 3's fixed KV cache), and
# comfy.ops.get_disabled_quant_formats (CLIP.generate's use_quantized_matmul, pick_operations)
QUERIES = {"comfy_kitchen": ("flash_attention_decode_is_available",),
           "comfy.model_management": ("supports_fp8_compute", "supports_nvfp4_compute", "supports_mxfp8_compute")}


def query_modules() -> dict[str, object]:
    """The modules of QUERIES by name, imported plainly; none outside ComfyUI."""
    try:
        import comfy.model_management
    except ImportError:
        return {}
    modules = {"comfy.model_management": comfy.model_management}
    try:
        import comfy_kitchen
    except ImportError:
        return modules
    return {**modules, "comfy_kitchen": comfy_kitchen}


def _has_the_bug(query) -> bool:
    """Asks CUDA about a CPU device as on an NVIDIA machine, answers on a machine without CUDA."""
    try:
        return asks_cuda_about_the_cpu(query) and not asks_cuda_about_the_cpu(query, nvidia=False)
    except Exception:  # noqa: BLE001  (a query that needs more than a device answers neither way: not this bug)
        return False


class CpuDeviceCudaQuery(Fix):
    id = FIX_ID
    targets = (Target.PROCESS,)
    retirement = Retirement(
        fixed_by="none yet for ComfyUI's supports_fp8/nvfp4/mxfp8_compute (Comfy-Org/ComfyUI #16365 open, PR #16374 "
                 "only moves the text encoder to the GPU under dynamic VRAM); comfy-kitchen 0.2.40 answers False for "
                 "a non-CUDA device in flash_attention_decode_is_available (comfy-kitchen #131)",
        delete_when="every supported core's queries answer for a CPU device without asking CUDA (this fix then reads "
                    "'fixed upstream' on all of them)")

    def __init__(self):
        self._lock = threading.Lock()
        self._installed: dict[tuple[str, str], object] = {}
        self._logged: set[str] = set()

    @staticmethod
    def queries() -> dict[tuple[str, str], object]:
        """The queries this install has, by (module, name), each as its module defines it: those of QUERIES, and any
        other ``supports_*`` capability query of ComfyUI's that takes the device first and, as on an NVIDIA machine,
        asks CUDA about a CPU device while it answers on a machine without CUDA (a query a newer core added or
        renamed, with the same bug: recognised by what it does)."""
        found = {}
        modules = query_modules()
        for module_name, names in QUERIES.items():
            module = modules.get(module_name)
            for name in names:
                if callable(getattr(module, name, None)):
                    found[module_name, name] = unguarded(getattr(module, name))
        module = modules.get("comfy.model_management")
        for name in sorted(name for name in (vars(module) if module else ()) if name.startswith("supports_")):
            query = unguarded(getattr(module, name))
            if (("comfy.model_management", name) not in found and inspect.isfunction(query)
                    and list(inspect.signature(query).parameters)[:1] == ["device"] and _has_the_bug(query)):
                found["comfy.model_management", name] = query
        return found

    def queries_asking_cuda(self) -> dict[tuple[str, str], object]:
        return {key: query for key, query in self.queries().items() if asks_cuda_about_the_cpu(query)}

    def detect(self) -> Status:
        queries = self.queries()
        if not queries:
            return Status(State.NOT_APPLICABLE, "no ComfyUI is importable here")
        drifted = [f"{module}.{name}{inspect.signature(query)}" for (module, name), query in queries.items()
                   if list(inspect.signature(query).parameters)[:1] != ["device"]]
        if drifted:
            return Status(State.FAILED, f"target drifted: {', '.join(drifted)} no longer take the device first")
        asking = self.queries_asking_cuda()
        if not asking:
            return Status(State.FIXED_UPSTREAM, "as on an NVIDIA machine, every query answers for a CPU device "
                                                f"without asking CUDA: {', '.join(_named(queries))}")
        unanswered = [name for name, query in zip(_named(asking), asking.values(), strict=True)
                      if asks_cuda_about_the_cpu(query, nvidia=False)]
        if unanswered:
            return Status(State.FAILED, f"target drifted: {', '.join(unanswered)} ask CUDA about a CPU device even "
                                        "on a machine without CUDA")
        answering = [name for name in _named(queries) if name not in _named(asking)]
        return Status(State.NEEDED, f"as on an NVIDIA machine, {', '.join(_named(asking))} ask CUDA about a CPU "
                                    "device (ValueError: Expected a cuda device, but got: cpu); a CPU device gets "
                                    "their answer as on a machine without CUDA, a CUDA device still asks CUDA"
                                    + (f"; fixed upstream: {', '.join(answering)}" if answering else ""))

    def _log_first_cpu_answer(self, name: str, device, answer) -> None:
        with self._lock:  # two threads with the same first answer must not both log it
            first = name not in self._logged
            self._logged.add(name)
        if first:
            log.info("MiniMax Hotfix: %s: answered %s(%s) as on a machine without CUDA: %s (a model on the CPU "
                     "asked; logged once)", FIX_ID, name, device, answer)

    def install(self) -> None:
        with self._lock:
            modules = query_modules()
            for module_name, name in self.queries_asking_cuda():
                module = modules[module_name]
                if getattr(module, name) is self._installed.get((module_name, name)):
                    continue
                wrapper = guarded(getattr(module, name), self._log_first_cpu_answer)
                setattr(module, name, wrapper)
                self._installed[module_name, name] = wrapper

    def uninstall(self) -> None:
        with self._lock:
            modules = query_modules()
            for (module_name, name), wrapper in self._installed.items():
                module = modules[module_name]
                if getattr(module, name, None) is wrapper:
                    setattr(module, name, wrapper.__wrapped__)
                else:
                    log.warning("MiniMax Hotfix: %s: %s.%s was replaced after this fix wrapped it; left as it is",
                                FIX_ID, module_name, name)
            self._installed.clear()
            self._logged.clear()  # a later install starts afresh: its first answers are logged again


def _named(queries: dict) -> list[str]:
    return [f"{module}.{name}" for module, name in queries]


FIX = CpuDeviceCudaQuery()
