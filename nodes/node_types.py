"""What the running ComfyUI says of a node type, for the server's routes and handlers that read API-format prompts
(which name node types, not their outputs)."""

from __future__ import annotations


def output_types(class_type: str) -> tuple:
    """A node type's output types, as the running ComfyUI defines them; none for a type it does not know."""
    import nodes

    try:
        return tuple(getattr(nodes.NODE_CLASS_MAPPINGS.get(class_type), "RETURN_TYPES", ()) or ())
    except Exception:  # noqa: BLE001  (a third-party node's broken definition only hides its outputs)
        return ()


def _input_types(class_type: str) -> set:
    import nodes

    declared = nodes.NODE_CLASS_MAPPINGS[class_type].INPUT_TYPES()
    return {spec[0] for group in ("required", "optional") for spec in (declared.get(group) or {}).values()
            if isinstance(spec, (list, tuple)) and spec and isinstance(spec[0], str)}


def loader_outputs(class_type: str) -> list | None:
    """``swap_loaders.swap_api``'s ``loader_outputs`` on this server: the table's entry where it has one, else, for
    any node type the server has, its outputs where one makes a new MODEL, CLIP or VAE (a type the node takes no input
    of), an output it passes on as None. So a third-party loader (a subclass of ComfyUI-GGUF's, a multi-GPU loader)
    gets its Apply node, and a LoRA loader does not."""
    from .. import swap_loaders

    known = swap_loaders.API_LOADER_OUTPUTS.get(class_type)
    if known is not None:
        return known
    outputs = output_types(class_type)
    if not any(io_type in swap_loaders.APPLY_NODE for io_type in outputs):
        return None
    try:
        taken = _input_types(class_type)
    except Exception:  # noqa: BLE001  (a node whose inputs cannot be read is left to the warning)
        return None
    made = [io_type if io_type in swap_loaders.APPLY_NODE and io_type not in taken else None for io_type in outputs]
    return made if any(made) else None
