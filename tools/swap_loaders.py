"""Move a ComfyUI workflow from the stock model loaders to MiniMax Hotfix's loaders, or back with --reverse.

    python custom_nodes/minimax-hotfix/tools/swap_loaders.py in.json [-o out.json | --in-place] [--reverse]

Reads a workflow in ComfyUI's UI format (nested subgraphs in ``definitions.subgraphs`` and legacy group nodes
included) or in API format, and turns every stock ``VAELoader``, ``CLIPLoader`` and ``UNETLoader`` into the pack's
loader of the same interface. Only the node type and the node's pack attribution change (``properties``:
``cnr_id``, ``ver``, ``Node name for S&R``); ids, links, positions, widget values, ``properties.models`` and
everything else stay as they were. ``--reverse`` turns every pack loader back into the stock one.

Swap then reverse gives back the original document exactly. Reverse recomputes a stock loader's attribution as
ComfyUI's frontend writes it (``comfy-core``, the ComfyUI version the workflow's other core nodes carry, the type as
search-and-replace name); where the original differed from that, the swap keeps the original attribution under the
properties key ``minimax_hotfix_original`` for the reverse to restore.

Standard library only: it runs with any Python 3.10+, no ComfyUI needed.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import re
import sys
import tempfile
from pathlib import Path

STOCK_TO_PACK = {
    "VAELoader": "MiniMaxHotfixVAELoader",
    "CLIPLoader": "MiniMaxHotfixCLIPLoader",
    "UNETLoader": "MiniMaxHotfixUNETLoader",
}
PACK_TO_STOCK = {pack: stock for stock, pack in STOCK_TO_PACK.items()}
PACK_CNR_ID = "minimax-hotfix"
CORE_CNR_ID = "comfy-core"
ATTRIBUTION_KEYS = ("cnr_id", "ver", "Node name for S&R")
ORIGINAL_KEY = "minimax_hotfix_original"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


class WorkflowError(Exception):
    """A document this tool cannot work on; the message says why."""


def pack_version(pyproject: Path = PYPROJECT) -> str:
    """The ``version`` of the pack's ``[project]`` table (a regex, so it works without tomllib on Python 3.10)."""
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkflowError(f"{pyproject}: cannot read the pack version: {exc.strerror}") from exc
    table = re.search(r"^\[project\][^\S\n]*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    version = table and re.search(r'^version\s*=\s*"([^"]+)"', table.group(1), re.M)
    if not version:
        raise WorkflowError(f"{pyproject}: no version in its [project] table")
    return version.group(1)


def workflow_format(doc) -> str:
    """``"ui"`` or ``"api"``; raises WorkflowError for anything else."""
    if isinstance(doc, dict) and isinstance(doc.get("nodes"), list):
        return "ui"
    if isinstance(doc, dict) and doc and all(
        isinstance(node, dict) and isinstance(node.get("class_type"), str) for node in doc.values()
    ):
        return "api"
    raise WorkflowError(
        "unrecognised format: expected a ComfyUI workflow, either UI format (an object with a \"nodes\" list) "
        "or API format (an object of nodes, each with a \"class_type\")"
    )


def _graphs(graph: dict):
    """The graph and every subgraph definition below it, however deeply nested."""
    yield graph
    definitions = graph.get("definitions")
    for subgraph in definitions.get("subgraphs", []) if isinstance(definitions, dict) else []:
        if isinstance(subgraph, dict):
            yield from _graphs(subgraph)


def ui_nodes(doc: dict) -> list[dict]:
    """Every node of a UI-format workflow: top level, subgraphs, and legacy group nodes (``extra.groupNodes``)."""
    found = []
    for graph in _graphs(doc):
        found += graph.get("nodes") or []
    extra = doc.get("extra")
    group_nodes = extra.get("groupNodes") if isinstance(extra, dict) else None
    for group in group_nodes.values() if isinstance(group_nodes, dict) else []:
        if isinstance(group, dict):
            found += group.get("nodes") or []
    for node in found:
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            raise WorkflowError(f"malformed UI workflow: a node without a \"type\" string: {str(node)[:80]}")
        if not isinstance(node.get("properties", {}), dict):
            raise WorkflowError(f"malformed UI workflow: node {node.get('id')} has \"properties\" that is not an object")
    return found


def _core_version(nodes: list[dict]):
    """The ComfyUI version most of the workflow's core nodes carry (None when none carries one)."""
    versions = collections.Counter(
        node["properties"]["ver"]
        for node in nodes
        if isinstance(node.get("properties"), dict)
        and node["properties"].get("cnr_id") == CORE_CNR_ID
        and "ver" in node["properties"]
    )
    return versions.most_common(1)[0][0] if versions else None


def _attribute(node: dict, node_type: str, cnr_id: str, ver) -> None:
    """Sets type and attribution in place, so keys that exist keep their position in the document."""
    node["type"] = node_type
    properties = node.setdefault("properties", {})
    properties["cnr_id"] = cnr_id
    if ver is None:
        properties.pop("ver", None)
    else:
        properties["ver"] = ver
    properties["Node name for S&R"] = node_type


def _reverse_ui_node(node: dict, core_ver) -> None:
    stock = PACK_TO_STOCK[node["type"]]
    properties = node.get("properties")
    if not isinstance(properties, dict) or ORIGINAL_KEY not in properties:
        _attribute(node, stock, CORE_CNR_ID, core_ver)
        return
    original = properties.pop(ORIGINAL_KEY)
    node["type"] = stock
    for key in ATTRIBUTION_KEYS:
        if original and key in original:
            properties[key] = original[key]
        else:
            properties.pop(key, None)
    if original is None and not properties:
        del node["properties"]


def _swap_ui(doc: dict, version: str) -> list[dict]:
    nodes = ui_nodes(doc)
    swapped = []
    for node in nodes:
        if node["type"] not in STOCK_TO_PACK:
            continue
        before = copy.deepcopy(node)
        properties = node.get("properties")
        original = None if properties is None else {key: properties[key] for key in ATTRIBUTION_KEYS if key in properties}
        _attribute(node, STOCK_TO_PACK[node["type"]], PACK_CNR_ID, version)
        node["properties"][ORIGINAL_KEY] = original
        swapped.append((node, before))
    # Keep the original attribution only where the reverse could not recompute it exactly.
    core_ver = _core_version(nodes)
    for node, before in swapped:
        trial = copy.deepcopy(node)
        del trial["properties"][ORIGINAL_KEY]
        _reverse_ui_node(trial, core_ver)
        if json.dumps(trial) == json.dumps(before):
            del node["properties"][ORIGINAL_KEY]
    return [node for node, _ in swapped]


def swap(doc, reverse: bool = False, version: str | None = None) -> list[dict]:
    """Swaps ``doc`` in place (stock -> pack, or pack -> stock with ``reverse``); returns the nodes it changed."""
    kind = workflow_format(doc)
    if kind == "api":
        mapping = PACK_TO_STOCK if reverse else STOCK_TO_PACK
        changed = [node for node in doc.values() if node["class_type"] in mapping]
        for node in changed:
            node["class_type"] = mapping[node["class_type"]]
        return changed
    if reverse:
        nodes = ui_nodes(doc)
        core_ver = _core_version(nodes)
        changed = [node for node in nodes if node["type"] in PACK_TO_STOCK]
        for node in changed:
            _reverse_ui_node(node, core_ver)
        return changed
    return _swap_ui(doc, version or pack_version())


def _json_layout(text: str) -> dict:
    """json.dumps arguments that reproduce the input's layout: indentation, spacing, escaping of non-ASCII."""
    layout = {"ensure_ascii": text.isascii()}
    indent = re.search(r"\n([ \t]+)\S", text)
    if indent:
        layout["indent"] = indent.group(1)
    elif "\n" in text.strip():
        layout["indent"] = 2
    else:
        key_colon = re.search(r'"\s*:(\s?)', text)
        layout["separators"] = (", ", ": ") if key_colon and key_colon.group(1) else (",", ":")
    return layout


def render(doc, original_text: str) -> str:
    text = json.dumps(doc, **_json_layout(original_text))
    return text + "\n" if original_text.endswith("\n") else text


def read_workflow(path: Path):
    """(document, text) of a workflow file; WorkflowError naming the file for unreadable or malformed input."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkflowError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkflowError(f"{path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    try:
        if workflow_format(doc) == "ui":
            ui_nodes(doc)
    except WorkflowError as exc:
        raise WorkflowError(f"{path}: {exc}") from None
    return doc, text


def write_atomically(path: Path, text: str) -> None:
    """Writes a temporary file beside ``path`` and renames it over ``path``: readers see the old or the new file,
    never a half-written one."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def default_output(source: Path, reverse: bool) -> Path:
    return source.with_name(f"{source.stem}.{'stock' if reverse else 'minimax-hotfix'}{source.suffix or '.json'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="swap_loaders.py",
        description="Swap a workflow's stock VAELoader/CLIPLoader/UNETLoader for MiniMax Hotfix's loaders "
        "(UI format with subgraphs, or API format). The input is never overwritten unless --in-place.",
    )
    parser.add_argument("input", type=Path, help="workflow JSON (UI or API format)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("-o", "--output", help="where to write (default: IN.minimax-hotfix.json, with "
                        "--reverse IN.stock.json; '-' for standard output)")
    target.add_argument("--in-place", action="store_true", help="replace the input file (atomically)")
    parser.add_argument("--reverse", action="store_true", help="turn the pack's loaders back into stock loaders")
    args = parser.parse_args(argv)

    if args.output == "-":
        output = None
    elif args.in_place:
        output = args.input
    else:
        output = Path(args.output) if args.output else default_output(args.input, args.reverse)
        if output.exists() and args.input.exists() and os.path.samefile(output, args.input):
            parser.error(f"{output} is the input file; pass --in-place to overwrite it")
    try:
        doc, text = read_workflow(args.input)
        changed = swap(doc, reverse=args.reverse)
        rendered = render(doc, text)
        if output is None:
            sys.stdout.write(rendered)
        else:
            write_atomically(output, rendered)
    except WorkflowError as exc:
        print(f"swap_loaders: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"swap_loaders: error: {exc.filename or output}: cannot write: {exc.strerror}", file=sys.stderr)
        return 1
    counts = collections.Counter(node.get("type") or node.get("class_type") for node in changed)
    before = STOCK_TO_PACK if args.reverse else PACK_TO_STOCK
    summary = ", ".join(f"{count} x {before[name]} -> {name}" for name, count in sorted(counts.items()))
    print(f"swap_loaders: {args.input}: {summary or 'no loaders to change'}; wrote "
          f"{'standard output' if output is None else output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
