"""Move ComfyUI workflows onto MiniMax Hotfix's loaders, or back with --reverse: the command line over the pack's
``swap_loaders.py`` (what the swap does: its docstring, and docs/swap_loaders.md).

    python custom_nodes/minimax-hotfix/tools/swap_loaders.py FILE... [-o OUT | --in-place [--force]] [--reverse] [--check]

Reads workflows in ComfyUI's UI format (subgraphs and legacy group nodes included) or in API format and writes them
with every stock loader swapped for the pack's (``--reverse``: back to the stock loaders). Standard library only:
it runs with any Python 3.10+, no ComfyUI or torch needed, from the pack's folder (it imports the pack's
``swap_loaders.py`` alone, through tools/minimax_hotfix, never the pack's ComfyUI entry point).
``--print-rules`` writes ``web/swap_rules.js``, the rules the pack's frontend extension uses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import stat
import sys
from pathlib import Path

# tools/minimax_hotfix is the pack without its ComfyUI entry point; isolated Pythons (python -I, ComfyUI portable's
# python_embeded, whose ._pth file turns isolated mode on) leave the script's own folder off the path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from minimax_hotfix.swap_loaders import (  # noqa: E402
    BOM,
    VERSION,
    WorkflowError,
    parse_json,
    rules_module,
    swap,
)

PROG = "swap_loaders"


# ---- files: the command line's alone (the library the server imports reads and returns documents only) ----

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
    """``doc`` as JSON laid out like ``original_text``: indentation, spacing, escaping, final newline, and the
    Windows editors' CRLF line ends and UTF-8 byte order mark."""
    body = original_text.removeprefix(BOM)
    text = json.dumps(doc, **_json_layout(body))
    text += "\n" if body.endswith("\n") else ""
    if "\r\n" in body:
        text = text.replace("\n", "\r\n")  # json.dumps escapes newlines inside strings: these are all line ends
    return BOM + text if original_text.startswith(BOM) else text


def read_workflow(path: Path):
    """(document, text) of a workflow file; WorkflowError naming the file for unreadable or malformed input."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise WorkflowError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise WorkflowError(f"{path}: cannot read: not UTF-8 text (byte {exc.start}); save the workflow as UTF-8 "
                            "or export it again from ComfyUI") from None
    try:
        return parse_json(text), text
    except WorkflowError as exc:
        raise WorkflowError(f"{path}: {exc}") from None


def _new_temporary(target: Path) -> tuple[int, str]:
    """A new file beside ``target``, opened for writing with mode 0o666 less the process's umask, as any new file
    gets (tempfile's are 0o600); the umask is applied by the system, never read by setting it."""
    for _ in range(100):
        temporary = str(target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp"))
        try:
            return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {target}")


def write_atomically(path: Path, text: str, force: bool = False) -> None:
    """Writes ``text`` to ``path`` through a temporary file beside the real file (a symlink is followed, not
    replaced), renamed over it: readers see the old or the new file, never half of one. An existing file keeps its
    mode and (POSIX) owner; a read-only one is refused unless ``force``. Errors name ``path``, never the temporary
    file. Only calls that Windows has, or guarded: Windows' ``os`` has no owner ids (no getuid, chown)."""
    target = Path(os.path.realpath(path))
    try:
        existing = target.stat()
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise WorkflowError(f"{path}: cannot write: {exc.strerror}") from None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        raise WorkflowError(f"{path}: cannot write: not a regular file")
    if existing is not None and not force and (not existing.st_mode & 0o222 or not os.access(target, os.W_OK)):
        raise WorkflowError(f"{path}: the file is read-only; pass --force to replace it anyway")
    if not target.parent.is_dir():
        raise WorkflowError(f"{path}: cannot write: folder {target.parent} does not exist")
    try:
        handle, temporary = _new_temporary(target)
    except OSError as exc:
        raise WorkflowError(f"{path}: cannot write in {target.parent}: {exc.strerror}") from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        if existing is not None:
            os.chmod(temporary, stat.S_IMODE(existing.st_mode))
            _keep_owner(temporary, existing)
            if force and os.name == "nt" and not existing.st_mode & stat.S_IWRITE:
                os.chmod(target, stat.S_IMODE(existing.st_mode) | stat.S_IWRITE)  # Windows: no rename onto it
        os.replace(temporary, target)
    except OSError as exc:
        os.unlink(temporary)
        raise WorkflowError(f"{path}: cannot write: {exc.strerror}") from None
    except BaseException:
        os.unlink(temporary)
        raise


def _keep_owner(temporary: str, existing: os.stat_result) -> None:
    """Gives the new file the old one's owner (root editing a user's file), where the system has owners."""
    if not (hasattr(os, "chown") and hasattr(os, "getuid") and hasattr(os, "getgid")):
        return
    if (existing.st_uid, existing.st_gid) != (os.getuid(), os.getgid()):
        os.chown(temporary, existing.st_uid, existing.st_gid)



def default_output(source: Path, reverse: bool) -> Path:
    return source.with_name(f"{source.stem}.{'stock' if reverse else 'minimax-hotfix'}{source.suffix or '.json'}")


LINE_BREAKS = {ord(char): f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"
               for char in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}  # what str.splitlines() splits at


def one_line(message: str) -> str:
    """``message`` with its line breaks escaped: node ids and types from the workflow may hold any character."""
    return message.translate(LINE_BREAKS)


def _report(message: str) -> None:
    """One line on standard error, with the tool's prefix."""
    print(f"{PROG}: {one_line(message)}", file=sys.stderr)


def _process(source: Path, args) -> int:
    """Swaps one file; returns 0 (done, or nothing to change), 1 (an error, or --check found something to change),
    2 (-o names the input file)."""
    if args.output == "-":
        output = None
    elif args.in_place:
        output = source
    else:
        output = Path(args.output) if args.output else default_output(source, args.reverse)
        if _same_file(output, source):
            _report(f"error: {output} is the input file; pass --in-place to overwrite it")
            return 2
    try:
        doc, text = read_workflow(source)
        try:
            changes = swap(doc, reverse=args.reverse)
        except WorkflowError as exc:
            raise WorkflowError(f"{source}: {exc}") from None
        for warning in changes.warnings:
            _report(f"warning: {source}: {warning}")
        if changes.kept:
            _report(f"warning: {source}: kept, not inserted by this tool: {changes.kept_names()}; remove them by hand "
                    "for a workflow that runs without the pack")
        if args.check:
            _report(f"{source}: {'would change: ' + changes.summary(args.reverse) if changes else 'nothing to change'}")
            return 1 if changes else 0
        if not changes:
            _report(f"{source}: nothing to change; wrote nothing")
            return 0
        rendered = render(doc, text)
        if output is None:
            sys.stdout.write(rendered)
        else:
            write_atomically(output, rendered, force=args.force)
    except WorkflowError as exc:
        _report(f"error: {exc}")
        return 1
    _report(f"{source}: {changes.summary(args.reverse)}; wrote {'standard output' if output is None else output}")
    return 0


def _same_file(output: Path, source: Path) -> bool:
    try:
        return output.exists() and source.exists() and os.path.samefile(output, source)
    except (OSError, ValueError):  # a name too long, or not one the system can take: the read or write will say
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Move ComfyUI workflows onto MiniMax Hotfix: stock VAELoader/CLIPLoader/UNETLoader become the "
        "pack's loaders, other MODEL/CLIP/VAE loaders get the pack's Apply node after them (UI format with "
        "subgraphs, or API format). The input is never overwritten unless --in-place.",
    )
    parser.add_argument("inputs", type=Path, nargs="*", metavar="FILE", help="workflow JSON (UI or API format)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("-o", "--output", help="where to write, for one FILE (default: FILE.minimax-hotfix.json, "
                        "with --reverse FILE.stock.json; '-' for standard output)")
    target.add_argument("--in-place", action="store_true", help="replace each FILE (atomically, through symlinks)")
    target.add_argument("--check", action="store_true",
                        help="write nothing; say what would change and exit 1 if anything would")
    target.add_argument("--print-rules", action="store_true",
                        help="print the swap rules as the JavaScript module web/swap_rules.js")
    parser.add_argument("--force", action="store_true", help="with --in-place, replace read-only files too")
    parser.add_argument("--reverse", action="store_true",
                        help="back to stock: the pack's loaders become stock ones, inserted Apply nodes go")
    parser.add_argument("--version", action="version", version=f"{PROG} {VERSION} (MiniMax Hotfix)")
    args = parser.parse_args(argv)
    if args.print_rules:
        sys.stdout.write(rules_module())
        return 0
    if not args.inputs:
        parser.error("no FILE given")
    if args.output and len(args.inputs) > 1:
        parser.error("-o/--output takes one FILE; use --in-place or the default names for several")
    if args.force and not args.in_place:
        parser.error("--force goes with --in-place")
    return max(_process(source, args) for source in args.inputs)


if __name__ == "__main__":
    sys.exit(main())
