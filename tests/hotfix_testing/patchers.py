"""Two patcher back-ends for the registry tests: ComfyUI's real ModelPatcher (with COMFYUI_PATH) and a
stand-in for CI that models the slice of ModelPatcher (ComfyUI 0.33.0) the registry relies on. The stand-in's
semantics are pinned against the real class by running the same tests on both."""

from __future__ import annotations

import torch

from hotfix_testing.comfy_memory import unload_all_models


class StandInPatcher:
    """Keyed injections, injected after a load and ejected on unload, copied by clone();
    ``cached_patcher_init`` = (factory, args) rebuilding a fresh patcher, as deepclone_multigpu uses it."""

    def __init__(self, model):
        self.model = model
        self.load_device = torch.device("cpu")
        self.injections: dict[str, list] = {}
        self.is_injected = False
        self.cached_patcher_init = None

    def set_injections(self, key, injections):
        self.injections[key] = injections

    def remove_injections(self, key):
        self.injections.pop(key, None)

    def get_injections(self, key):
        return self.injections.get(key)

    def inject_model(self):
        if self.is_injected:
            return
        for injections in self.injections.values():
            for injection in injections:
                injection.inject(self)
                self.is_injected = True

    def eject_model(self):
        if not self.is_injected:
            return
        for injections in self.injections.values():
            for injection in injections:
                injection.eject(self)
        self.is_injected = False

    def clone(self, model=None):
        clone = StandInPatcher(self.model if model is None else model)
        clone.injections = {k: list(v) for k, v in self.injections.items()}
        clone.is_injected = self.is_injected if model is None else False
        clone.cached_patcher_init = self.cached_patcher_init
        return clone


class StandInBackend:
    name = "stand-in"

    def patcher(self, model, factory_args=None):
        patcher = StandInPatcher(model)
        if factory_args is not None:
            patcher.cached_patcher_init = (self.rebuildable, factory_args)
        return patcher

    def rebuildable(self, build):
        return self.patcher(build(), (build,))

    def load(self, patcher):
        patcher.inject_model()

    def unload(self, patcher):
        patcher.eject_model()

    def rebuild(self, patcher):
        factory, args = patcher.cached_patcher_init
        return patcher.clone(model=factory(*args).model)


class ComfyBackend:
    """ComfyUI's own ModelPatcher, model_management load/unload and deepclone_multigpu rebuild (on CPU)."""

    name = "comfyui"

    def __init__(self):
        import comfy.model_management as mm
        import comfy.model_patcher as mp
        import torch

        self.mm, self.mp, self.cpu = mm, mp, torch.device("cpu")

    def patcher(self, model, factory_args=None):
        patcher = self.mp.ModelPatcher(model, load_device=self.cpu, offload_device=self.cpu)
        if factory_args is not None:
            patcher.cached_patcher_init = (self.rebuildable, factory_args)
        return patcher

    def rebuildable(self, build, **_):
        return self.patcher(build(), (build,))

    def load(self, patcher):
        self.mm.load_models_gpu([patcher], force_full_load=True)

    def unload(self, patcher):
        unload_all_models()

    def rebuild(self, patcher):
        return patcher.deepclone_multigpu()
