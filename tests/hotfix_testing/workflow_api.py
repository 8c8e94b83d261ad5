"""UI-format workflows (as saved by ComfyUI's frontend) to API-format prompts (as its "Queue" sends them)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import NamedTuple

TEMPLATES = resources.files("comfyui_workflow_templates_json") / "templates"  # ComfyUI's template package
# the official templates run end to end (tests/test_official_templates_on_device.py), by the file stem in TEMPLATES
OFFICIAL_TEMPLATES = {"H3 text-to-video": "video_minimax_h3_t2v", "H3 image-to-video": "video_minimax_h3_i2v",
                      "H3 reference-to-video": "video_minimax_h3_r2v",
                      "H3 continuation": "video_minimax_h3_i2v_continuation", "Music 3": "audio_minimax_music_3"}
FRONTEND_ONLY = {"MarkdownNote", "Note"}  # drawn by the frontend, never sent to the server
# a model file widget -> the ComfyUI models folder its options come from
MODEL_FOLDERS = {"unet_name": "diffusion_models", "clip_name": "text_encoders", "vae_name": "vae",
                 "ckpt_name": "checkpoints", "lora_name": "loras"}
MODEL_FILE_INPUTS = set(MODEL_FOLDERS)
FOLDER_LISTED_INPUTS = MODEL_FILE_INPUTS | {"image"}  # options depend on the files of the ComfyUI at hand
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", DYNAMIC_COMBO}


class WidgetMismatch(AssertionError):
    pass


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def official_template(stem: str) -> dict:
    return load(TEMPLATES / f"{stem}.json")


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


SUBGRAPH_INPUT_NODE, SUBGRAPH_OUTPUT_NODE = -10, -20  # the ids of a subgraph's input and output nodes


class Promoted(NamedTuple):
    """The value of a subgraph instance's widget, fed to the inner inputs its subgraph input links to."""

    value: object


def _origins(links: list) -> dict:
    """link id -> (origin node id, origin slot): the top level saves its links as lists, subgraphs as objects."""
    rows = [link if isinstance(link, list) else [link["id"], link["origin_id"], link["origin_slot"]] for link in links]
    return {row[0]: (row[1], row[2]) for row in rows}


def _promoted_widgets(instance: dict, subgraph: dict) -> dict:
    """Subgraph input name -> the instance's widget value: the frontend gives the instance one widget per subgraph
    input that links to an inner widget, in the subgraph's input order, and saves their values in that order."""
    nodes = {node["id"]: node for node in subgraph["nodes"]}
    links = {link["id"]: link for link in subgraph["links"]}

    def feeds_widget(link_id) -> bool:
        link = links[link_id]
        return "widget" in nodes[link["target_id"]]["inputs"][link["target_slot"]]

    names = [entry["name"] for entry in subgraph["inputs"] if any(map(feeds_widget, entry.get("linkIds", [])))]
    values = instance.get("widgets_values") or []
    if len(values) != len(names):
        raise WidgetMismatch(f"node {instance['id']}: {len(values)} widget values for promoted inputs {names}")
    return dict(zip(names, values, strict=True))


def _subgraph_definitions(graph: dict):
    for subgraph in (graph.get("definitions") or {}).get("subgraphs") or []:
        yield subgraph
        yield from _subgraph_definitions(subgraph)


def ui_to_api(workflow: dict, specs: dict) -> dict:
    """UI-format workflow -> API-format prompt, as the frontend's "Queue" sends it: subgraphs lowered (a node inside
    instance 5 of a subgraph is "5:id", nested instances "5:7:id"), links through a subgraph's input and output nodes
    taken to their producers, a subgraph input the instance leaves unlinked given the instance's widget value (or
    left out), frontend-only nodes dropped. Muted and bypassed nodes are refused: no workflow here has them."""
    subgraphs = {subgraph["id"]: subgraph for subgraph in _subgraph_definitions(workflow)}
    prompt: dict = {}

    def lower(graph: dict, prefix: str, outer_input):
        origins = _origins(graph["links"])
        nodes = {node["id"]: node for node in graph["nodes"]}

        def source(link_id):
            """The producer ([id, slot]) or Promoted value behind a link, None where nothing feeds it."""
            origin, slot = origins[link_id]
            if origin == SUBGRAPH_INPUT_NODE:
                return outer_input(slot)
            node = nodes[origin]
            if node["type"] not in subgraphs:
                return [f"{prefix}{origin}", slot]
            subgraph = subgraphs[node["type"]]
            (inner_link,) = subgraph["outputs"][slot]["linkIds"]
            return instance_source(node)(inner_link)

        instances = {}

        def instance_source(node):
            """The link resolver of a subgraph instance of this graph, lowered into the prompt on first use."""
            if node["id"] not in instances:
                subgraph = subgraphs[node["type"]]
                promoted = _promoted_widgets(node, subgraph)
                linked = {slot["name"]: slot["link"] for slot in node.get("inputs", []) if slot.get("link") is not None}

                def instance_input(slot):
                    name = subgraph["inputs"][slot]["name"]
                    if name in linked:
                        return source(linked[name])
                    return Promoted(promoted[name]) if name in promoted else None

                instances[node["id"]] = lower(subgraph, f"{prefix}{node['id']}:", instance_input)
            return instances[node["id"]]

        for node in graph["nodes"]:
            if node["type"] in FRONTEND_ONLY:
                continue
            assert node.get("mode", 0) == 0, f"node {prefix}{node['id']} is muted or bypassed"
            if node["type"] in subgraphs:
                instance_source(node)
                continue
            try:
                inputs = widget_inputs(specs[node["type"]], node.get("widgets_values") or [])
            except WidgetMismatch as exc:
                raise WidgetMismatch(f"node {prefix}{node['id']} ({node['type']}): {exc}") from None
            for slot in node.get("inputs", []):
                if slot.get("link") is None:
                    continue
                fed = source(slot["link"])
                if fed is None:
                    inputs.pop(slot["name"], None)
                else:
                    inputs[slot["name"]] = fed.value if isinstance(fed, Promoted) else fed
            prompt[f"{prefix}{node['id']}"] = {"class_type": node["type"], "inputs": inputs,
                                              "_meta": {"title": node.get("title") or node["type"]}}
        return source

    lower(workflow, "", None)
    return prompt
