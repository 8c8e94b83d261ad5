"""UI-format workflows (as saved by ComfyUI's frontend) to API-format prompts (as its "Queue" sends them)."""

from __future__ import annotations

import json
from pathlib import Path

FRONTEND_ONLY = {"MarkdownNote", "Note"}  # drawn by the frontend, never sent to the server
MODEL_FILE_INPUTS = {"unet_name", "clip_name", "vae_name", "ckpt_name"}
FOLDER_LISTED_INPUTS = MODEL_FILE_INPUTS | {"image"}  # options depend on the files of the ComfyUI at hand
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", DYNAMIC_COMBO}


class WidgetMismatch(AssertionError):
    pass


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _ordered_inputs(spec: dict):
    """(name, io_type, options) in the order the frontend lays out widgets: required, then optional."""
    order = spec.get("input_order") or {section: list(spec["input"].get(section, {})) for section in ("required", "optional")}
    for section in ("required", "optional"):
        for name in order.get(section, []):
            entry = spec["input"][section][name]
            yield name, entry[0], entry[1] if len(entry) > 1 else {}


def _is_widget(io_type, options: dict) -> bool:
    return (isinstance(io_type, list) or io_type in WIDGET_TYPES) and not options.get("forceInput")


def _check_value(name: str, io_type, options: dict, value):
    """Why ``value`` does not fit the input, or None."""
    if isinstance(io_type, list) or io_type == "COMBO":
        choices = io_type if isinstance(io_type, list) else options.get("options", [])
        if name in FOLDER_LISTED_INPUTS:
            return None if isinstance(value, str) and value else f"{name}: expected a file name, got {value!r}"
        return None if value in choices else f"{name}: {value!r} is not one of {choices}"
    if io_type == "INT" and (not isinstance(value, int) or isinstance(value, bool)):
        return f"{name}: expected an integer, got {value!r}"
    if io_type == "FLOAT" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        return f"{name}: expected a number, got {value!r}"
    if io_type in ("INT", "FLOAT") and not options.get("min", value) <= value <= options.get("max", value):
        return f"{name}: {value} outside [{options.get('min')}, {options.get('max')}]"
    if io_type == "STRING" and not isinstance(value, str):
        return f"{name}: expected a string, got {value!r}"
    if io_type == "BOOLEAN" and not isinstance(value, bool):
        return f"{name}: expected a boolean, got {value!r}"
    return None


def widget_inputs(spec: dict, widgets_values: list) -> dict:
    """Maps a node's widgets_values onto its inputs as the frontend lays them out, checking each value.

    Follows the frontend's rules for the inputs the bundled workflows use: a control widget after inputs with
    ``control_after_generate``, an upload widget after ``image_upload``, the inputs of the chosen option right after
    a dynamic combo (API keys ``parent.child``), nothing for hidden or socket-only inputs.
    """
    values = list(widgets_values)
    found = {}

    def take(what):
        if not values:
            raise WidgetMismatch(f"no widget value left for {what}")
        return values.pop(0)

    def walk(inputs, prefix):
        for name, io_type, options in inputs:
            if options.get("hidden") or not _is_widget(io_type, options):
                continue
            key = prefix + name
            value = found[key] = take(key)
            if io_type == DYNAMIC_COMBO:
                chosen = [option for option in options["options"] if option["key"] == value]
                if not chosen:
                    raise WidgetMismatch(f"{key}: {value!r} is not one of {[o['key'] for o in options['options']]}")
                walk(_ordered_inputs({"input": chosen[0]["inputs"]}), key + ".")
                continue
            problem = _check_value(key, io_type, options, value)
            if problem:
                raise WidgetMismatch(problem)
            if options.get("control_after_generate") and take(f"{key} (control after generate)") not in CONTROL_VALUES:
                raise WidgetMismatch(f"{key}: control after generate is not one of {sorted(CONTROL_VALUES)}")
            if options.get("image_upload"):
                take(f"{key} (upload button)")

    walk(_ordered_inputs(spec), "")
    if values:
        raise WidgetMismatch(f"{len(values)} widget values left over: {values!r}")
    return found


def ui_to_api(workflow: dict, specs: dict) -> dict:
    """UI-format workflow -> API-format prompt, as the frontend's "Queue" sends it (flat graphs, all nodes active)."""
    if (workflow.get("definitions") or {}).get("subgraphs"):
        raise NotImplementedError("subgraphs: the bundled workflows are flat")
    links = {link[0]: link for link in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        if node["type"] in FRONTEND_ONLY:
            continue
        assert node.get("mode", 0) == 0, f"node {node['id']} is muted or bypassed"
        try:
            inputs = widget_inputs(specs[node["type"]], node.get("widgets_values") or [])
        except WidgetMismatch as exc:
            raise WidgetMismatch(f"node {node['id']} ({node['type']}): {exc}") from None
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                link = links[slot["link"]]
                inputs[slot["name"]] = [str(link[1]), link[2]]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs,
                                   "_meta": {"title": node.get("title") or node["type"]}}
    return prompt
