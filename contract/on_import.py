"""Patching a module the moment it is imported, for process-wide fixes whose target is too slow to import at ComfyUI
start-up (the pack must never import it itself)."""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable


class _PatchAfterExec(importlib.abc.Loader):
    """Runs the real loader, then patches the freshly executed module; everything else goes to the real loader."""

    def __init__(self, loader, patch: Callable):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class WrapOnImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that runs ``patch(module)`` right after the module ``name`` is imported."""

    def __init__(self, name: str, patch: Callable):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchAfterExec(spec.loader, self.patch)
                return spec
        return None
