"""The pack's per-model fixes inside raylight's Ray actors (komikndr/raylight: MiniMax H3 on several GPUs).

raylight's ``RayUNETLoader`` (and ``RayGGUFLoader``) returns ``RAY_ACTORS``, not a MODEL: one Ray actor per GPU, each
a process of its own that builds its own model (``self.model``, a ComfyUI ModelPatcher). The main process's patcher
never crosses, so what a node sets on it stays behind, and only raylight and ComfyUI's root are importable in an
actor, not this pack. raylight's hook for other nodes is the actor method ``model_function_runner_get_values(fn,
*args)``: ``fn(self.model, *args)`` in the actor, its result sent back (``comfy_extra_dist/ray_patch_decorator.py``).

So the pack goes to the actors by value: its runtime packages (``RUNTIME_PACKAGES``) travel as source text, which an
actor writes once into a fresh folder of its own and imports as ``ACTOR_PACKAGE``, and ``attach_in_actor`` itself is
pickled by value (Ray's cloudpickle, ``register_pickle_by_value`` on this module): ComfyUI registers a custom node's
modules under its file path, which no actor can import, so by reference a fresh actor fails with
``ModuleNotFoundError``. In the actor the pack's registry detects each fix on that process's ComfyUI and attaches
the needed MODEL fixes to the actor's patcher as the pack's loader does, the dtype choice made on the actor's own
device (``own_patcher``: the actor's model is raylight's, loaded for this workflow, and goes with the next load).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from ..contract import log

RUNTIME_PACKAGES = ("contract", "kernels", "patches", "registry")
ACTOR_PACKAGE = "minimax_hotfix_in_actor"


class LastRun:
    """What the Apply node did in the actors the last time it ran, for the Status node and the doctor."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reports: list[dict] | None = None

    def record(self, reports: list[dict]) -> None:
        with self._lock:
            self._reports = reports

    def describe(self) -> str:
        with self._lock:
            reports = self._reports
        if reports is None:
            return ("Apply MiniMax Hotfix (Ray actors) has not run in this ComfyUI: put it after raylight's "
                    "RayUNETLoader / RayGGUFLoader (the swap does) for MiniMax H3 on several GPUs")
        actors = "; ".join(f"{report['device']}: {', '.join(report['attached']) or 'nothing needed'}, H3 in "
                           f"{report['compute_dtype'].removeprefix('torch.')}" for report in reports)
        return f"last run: {len(reports)} Ray actor(s): {actors}"


LAST_RUN = LastRun()


def pack_sources() -> dict[str, str]:
    """The pack's runtime packages as {path relative to the pack: source text}."""
    root = Path(__file__).resolve().parents[1]
    return {path.relative_to(root).as_posix(): path.read_text(encoding="utf-8")
            for package in RUNTIME_PACKAGES for path in sorted((root / package).glob("*.py"))}


def attach_in_actor(patcher, sources: dict[str, str]) -> dict:
    """Runs in a Ray actor on its ModelPatcher: imports the shipped pack (once per actor process) and attaches its
    needed MODEL fixes to ``patcher``; returns what it did. Imports nothing of the pack at module level: it is
    pickled by value, and everything it needs comes in ``sources``."""
    import importlib
    import os
    import tempfile

    if ACTOR_PACKAGE not in sys.modules:
        folder = tempfile.mkdtemp(prefix="minimax_hotfix_")
        for relative, text in {"__init__.py": '"""MiniMax Hotfix, shipped to this process by value."""\n',
                               **sources}.items():
            path = os.path.join(folder, ACTOR_PACKAGE, *relative.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as file:
                file.write(text)
        sys.path.insert(0, folder)
    registry = importlib.import_module(f"{ACTOR_PACKAGE}.registry")
    target = importlib.import_module(f"{ACTOR_PACKAGE}.contract").Target.MODEL
    attached = registry.attach_fixes(patcher, target, own_patcher=True)
    manual_cast = patcher.get_model_object("manual_cast_dtype")
    return {"attached": attached, "device": str(patcher.load_device),
            "compute_dtype": str(manual_cast if manual_cast is not None else patcher.model.get_dtype())}


def attach_in_every_actor(ray_actors) -> list[dict] | None:
    """The needed MODEL fixes attached in every actor of raylight's ``ray_actors`` (its ``workers``); each actor's
    report, or None (logged) where ``ray_actors`` is not raylight's or Ray is not importable here."""
    workers = ray_actors.get("workers") if isinstance(ray_actors, dict) else None
    if not workers or not all(hasattr(worker, "model_function_runner_get_values") for worker in workers):
        log.warning("MiniMax Hotfix: MiniMaxHotfixApplyRayActors got %s, not raylight's RAY_ACTORS (a dict whose "
                    "'workers' are Ray actors): passed on unchanged, no fix attached", type(ray_actors).__name__)
        return None
    try:
        import ray
        from ray import cloudpickle
    except ImportError as exc:
        log.warning("MiniMax Hotfix: MiniMaxHotfixApplyRayActors: Ray is not importable here (%s): no fix attached",
                    exc)
        return None
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    sources = pack_sources()
    reports = ray.get([worker.model_function_runner_get_values.remote(attach_in_actor, sources)
                       for worker in workers])
    LAST_RUN.record(reports)
    for rank, report in enumerate(reports):
        log.info("MiniMax Hotfix: Ray actor %d (%s): attached %s; MiniMax H3 computes in %s there", rank,
                 report["device"], ", ".join(report["attached"]) or "no fix (none needed)",
                 report["compute_dtype"].removeprefix("torch."))
    return reports
