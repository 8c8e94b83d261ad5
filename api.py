"""The pack's public functions, for other custom nodes (``import minimax_hotfix`` inside ComfyUI). These names are
stable; each goes through the registry, so a fix that is broken (its module failed to import), switched off
(MINIMAX_HOTFIX_DISABLE) or retired (fixed upstream, not needed here) makes the call a logged no-op, never an error."""

from __future__ import annotations

from . import registry
from .contract import State, log

TRANSFORMERS_QWEN3VL_POS_EMBED = "transformers_qwen3vl_pos_embed"


def attach_to_transformers_model(model) -> list[str]:
    """Make every Qwen3-VL-family vision tower inside a transformers ``model`` device-safe; return the patched module
    names (e.g. ``["model.visual"]``), or [] when the fix attaches nothing here (the log says why).

    For custom nodes that run transformers' Qwen3-VL / Qwen3.5 / Qwen3-Omni models (captioners, prompt enhancers) next
    to MiniMax workflows and may keep ``pos_embed`` in CPU RAM, offload it, or pass ``grid_thw`` on the CPU::

        import minimax_hotfix
        model = Qwen3VLForConditionalGeneration.from_pretrained(...)
        minimax_hotfix.attach_to_transformers_model(model)

    Only ``model``'s own modules change, so other models are untouched; calling it again replaces, never stacks;
    ``detach_from_transformers_model`` undoes it. Safe with concurrent calls from several threads.
    """
    fix = registry.fix_named(TRANSFORMERS_QWEN3VL_POS_EMBED)
    if fix is None:
        log.warning("MiniMax Hotfix: %s not attached: its module failed to import (%s)", TRANSFORMERS_QWEN3VL_POS_EMBED,
                    registry.broken_modules().get(TRANSFORMERS_QWEN3VL_POS_EMBED, "not found"))
        return []
    found = registry.status(fix)
    if found.state is not State.NEEDED:
        log.info("MiniMax Hotfix: %s not attached: %s (%s)", fix.id, found.state.value, found.reason)
        return []
    return fix.attach_to_towers(model)


def detach_from_transformers_model(model) -> None:
    """Undo ``attach_to_transformers_model`` on every tower of ``model`` (nothing to undo when it attached nothing)."""
    fix = registry.fix_named(TRANSFORMERS_QWEN3VL_POS_EMBED)
    if fix is not None:
        fix.detach_from_towers(model)


__all__ = ["attach_to_transformers_model", "detach_from_transformers_model"]
