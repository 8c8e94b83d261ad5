"""Self-test of cpu_device_cuda_query: each capability query this install asks CUDA with about a CPU device, asked
about the CPU on an NVIDIA machine (red: torch's ValueError), then through the fix's wrapper (green: the answer of an
all-CPU run); a CUDA device, and the current one, still reach the query itself. On an NVIDIA machine the queries are
asked as they are; elsewhere as on one (the fix's machine views), and this machine's own answer is the all-CPU one."""

from __future__ import annotations

import torch

from ...contract import Check
from ...contract.comfy import comfy_module
from ...kernels.cpu_device_cuda_query import guarded, on_machine
from ...patches.cpu_device_cuda_query import FIX

RED_TEXT = "Expected a cuda device, but got: cpu"
CPU = torch.device("cpu")


def error_text(call) -> str | None:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


def self_test():
    asking = FIX.queries_asking_cuda()
    if not asking:
        return []
    on_nvidia = torch.cuda.is_available() and comfy_module("comfy.model_management").is_nvidia()
    machine = "this NVIDIA machine" if on_nvidia else "an NVIDIA machine (emulated)"
    named = {f"{module}.{name}": query for (module, name), query in asking.items()}
    checks = []
    for name, query in named.items():
        raised = error_text(lambda query=query: (query if on_nvidia else on_machine(query, nvidia=True))(CPU))
        checks.append(Check(f"red: {name}(cpu) on {machine} raises", raised == RED_TEXT, raised or "no error"))
    for name, query in named.items():
        asked = query if on_nvidia else on_machine(query, nvidia=True)
        answer = guarded(asked, lambda *_: None)(CPU)
        all_cpu = on_machine(query, nvidia=False)(CPU) if on_nvidia else query(CPU)
        checks.append(Check(f"green: {name}(cpu) through the fix on {machine} answers as an all-CPU run",
                            answer == all_cpu, f"{answer} (all-CPU run: {all_cpu})"))
    checks.append(cuda_devices_reach_the_query())
    return checks


def cuda_devices_reach_the_query() -> Check:
    devices = [torch.device("cuda", 0), 0, None]
    asked = []

    def query(device=None):
        asked.append(device)
        return f"answer for {device}"

    answers = [guarded(query, lambda *_: None)(device) for device in devices]
    return Check("green: cuda:0, index 0 and the current device (None) reach the query itself",
                 asked == devices and answers == [f"answer for {device}" for device in devices], f"asked: {asked}")
