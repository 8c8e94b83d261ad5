"""ComfyUI's own prompt validation before and after server-side fixing, in one ComfyUI process with the pack loaded:
run with ComfyUI's Python as ``python tests/hotfix_testing/prompt_validation.py COMFYUI_PATH MODELS_FOLDER CUSTOM_NODES < prompts.json``
(CUSTOM_NODES: the other custom nodes to load, e.g. the GGUF stand-in: tests/hotfix_testing/comfyui_server.install_custom_nodes), where
prompts.json is ``{name: API prompt}`` (``--red-control NAME``: afterwards prompt NAME again, with the swap turning a
stock VAELoader into a node type ComfyUI does not have, which the check must catch: the row "red control: NAME").
Prints one JSON object, per prompt name: whether it validated before and after
the pack's on-prompt handler (switch on), whether the handler changed it, the error types of each validation, and the
median seconds of the handler and of ``execution.validate_prompt`` over REPEATS calls (the benchmark's ratio).

MODELS_FOLDER holds the model files the prompts name (``<folder>/<kind>/<name>``, empty files do: validation checks
names, not contents) and ``input/`` the images. Used by tests/test_server_side_fixing.py and
benchmarks/prompt_fixing.py."""

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPEATS = 7
RED_CONTROL = "red control: "  # the name of the red-control row for prompt NAME (--red-control NAME)


def load_comfyui(comfyui: str, models: Path, custom_nodes: Path):
    # ComfyUI is imported from its checkout, as main.py does: it is no package on any path
    sys.path.insert(0, comfyui)
    os.chdir(comfyui)
    from comfy.cli_args import args

    args.cpu = True
    import folder_paths

    import nodes

    for kind in os.listdir(models):
        if kind != "input":
            folder_paths.add_model_folder_path(kind, str(models / kind), is_default=True)
    folder_paths.set_input_directory(str(models / "input"))
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False))
    for entry in sorted(custom_nodes.iterdir()):
        asyncio.run(nodes.load_custom_node(str(entry)))
    pack = str(Path(__file__).resolve().parents[2])
    assert asyncio.run(nodes.load_custom_node(pack, ignore=set(nodes.NODE_CLASS_MAPPINGS))), "the pack did not load"
    import minimax_hotfix

    return minimax_hotfix


def median_seconds(call) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def median_validation_seconds(validate_prompt, prompt) -> float:
    """As the server awaits it: inside one running event loop."""
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        await validate_prompt("minimax-hotfix-validation", prompt, None)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    pack = load_comfyui(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
    import execution

    from minimax_hotfix.registry.prompt_fixing import PROMPT_FIXING  # the copy ComfyUI loaded, as the server runs it

    assert pack.registry.prompt_fixing.PROMPT_FIXING is PROMPT_FIXING

    def validate(prompt):
        return asyncio.run(execution.validate_prompt("minimax-hotfix-validation", prompt, None))

    def error_types(result) -> list[str]:
        found = [] if result[1] is None else [result[1].get("type", "?")]
        return found + sorted({error["type"] for node in result[3].values() for error in node.get("errors", [])})

    def row(name, prompt, timed=True) -> dict:
        body = {"prompt": prompt, "extra_data": {"extra_pnginfo": {"workflow": {"saved": name}}}}
        fixed = PROMPT_FIXING.fixed_body(body, True)
        before, after = validate(prompt), validate(fixed["prompt"])
        return {
            "nodes": len(prompt), "changed": fixed is not body, "valid_before": before[0], "valid_after": after[0],
            "errors_before": error_types(before), "errors_after": error_types(after),
            "extra_data_kept": fixed.get("extra_data") == body["extra_data"],
            **({"handler_s": median_seconds(lambda: PROMPT_FIXING.fixed_body(body, True)),
                "validate_s": asyncio.run(median_validation_seconds(execution.validate_prompt, prompt))}
               if timed else {}),
        }

    prompts = json.load(sys.stdin)
    outcome = {name: row(name, prompt) for name, prompt in prompts.items()}
    if "--red-control" in sys.argv:  # afterwards, in the same process: the swap turned into a node type ComfyUI lacks
        from minimax_hotfix import swap_loaders

        name = sys.argv[sys.argv.index("--red-control") + 1]
        swap_loaders.STOCK_TO_PACK["VAELoader"] = "MiniMaxHotfixVAELoaderThatIsNot"
        swap_loaders.PACK_TO_STOCK["MiniMaxHotfixVAELoaderThatIsNot"] = "VAELoader"
        outcome[RED_CONTROL + name] = row(name, prompts[name], timed=False)
    print(json.dumps(outcome))


if __name__ == "__main__":
    main()
