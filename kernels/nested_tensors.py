"""Moving the tensors nested in a model's keyword inputs (dicts, lists, tuples) onto one device.

Containers are rebuilt only where something moved, so an input that is already in place comes back as the same
object. Anything that is not a tensor or one of those containers (a KV cache object, a config, a number) is returned
untouched, never traversed: a cache owns its buffers and places them itself.
"""

from __future__ import annotations

import copy

import torch


def move_nested(value, device: torch.device):
    """``value`` with every tensor inside its dicts, lists and tuples on ``device``; ``value`` itself if none moved."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, dict):
        moved = {key: move_nested(item, device) for key, item in value.items()}
        if all(moved[key] is item for key, item in value.items()):
            return value
        # A shallow copy keeps a dict subclass's type and attributes (transformers' ModelOutput, BatchEncoding).
        rebuilt = copy.copy(value)
        for key, item in moved.items():
            if item is not value[key]:
                rebuilt[key] = item
        return rebuilt
    if isinstance(value, (list, tuple)):
        moved = [move_nested(item, device) for item in value]
        if all(new is old for new, old in zip(moved, value)):
            return value
        if isinstance(value, list):
            rebuilt = copy.copy(value)
            rebuilt[:] = moved
            return rebuilt
        if hasattr(value, "_fields"):  # a namedtuple takes its items as separate arguments
            return type(value)(*moved)
        return type(value)(moved)
    return value


def nested_tensors(value):
    """The tensors inside ``value``'s dicts, lists and tuples, depth first (not ``value`` itself if it is one)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        else:
            yield from nested_tensors(item)
