"""The pack's doctor: environment, each fix's state, and each fix's self-test (red control, then green).

    python tools/doctor.py                 # everything; exit 1 if a self-test step fails
    python tools/doctor.py --json          # the same as one JSON document (docs/doctor.md)
    python tools/doctor.py --fix ID        # one fix's state and self-test
    python tools/doctor.py --explain TEXT  # which fix repairs this error (- reads it from stdin), then as --fix
    python tools/doctor.py --audit FILE..  # the placement audit of model files
    python tools/doctor.py --version

With COMFYUI_PATH set, the fixes are detected against that ComfyUI checkout (its requirements must be
installed in the running Python). Exit codes: 0 all passed, 1 a self-test step failed, 2 the doctor could not run
(bad arguments, no torch, an unusable COMFYUI_PATH, an unknown fix id or error, no placement audit).
"""

import argparse
import contextlib
import importlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

# tools/minimax_hotfix is the pack without its ComfyUI entry point; isolated Pythons (python -I, ComfyUI portable's
# python_embeded, whose ._pth file turns isolated mode on) leave the script's own folder off the path
sys.path.insert(0, str(Path(__file__).resolve().parent))
AUDIT_MODULE = "minimax_hotfix.diagnostics.placement_audit"
CANNOT_RUN = 2


class DoctorError(Exception):
    """Ends the doctor with one line on stderr and exit code 2."""


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="doctor", description="MiniMax Hotfix doctor: prints the environment and each fix's state, then runs each "
        "fix's self-test on tiny built-in models. Set COMFYUI_PATH to check the fixes against a ComfyUI checkout "
        "(run the doctor with that ComfyUI's Python).",
        epilog="exit codes: 0 all self-tests passed, 1 a self-test step failed, 2 the doctor could not run")
    parser.add_argument("--version", action="store_true", help="print the pack version (and git commit) and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text (docs/doctor.md)")
    one_fix = parser.add_mutually_exclusive_group()
    one_fix.add_argument("--fix", metavar="ID", help="only this fix's state and self-test")
    one_fix.add_argument("--explain", metavar="TEXT",
                         help="which fix repairs this error (its message, better the whole traceback; - reads it "
                              "from stdin), then that fix's state and self-test")
    parser.add_argument("--audit", nargs="*", metavar="FILE",
                        help="run the placement audit on these model files instead of the self-tests")
    return parser.parse_args(argv)


def require_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        raise DoctorError(f"torch is not installed in {sys.executable}: run the doctor in the pack's test environment "
                          "(bash tools/venv.sh python tools/doctor.py) or with ComfyUI's own Python")


def select_fixes(fix_id):
    """Every fix (None), or the one fix ``fix_id`` names (case-insensitive)."""
    if fix_id is None:
        return None
    from minimax_hotfix.registry import all_fixes

    fixes = {fix.id.lower(): fix for fix in all_fixes().values()}
    if fix_id.lower() not in fixes:
        raise DoctorError(f"unknown fix id {fix_id!r}; known ids: {', '.join(sorted(fixes))}")
    return [fixes[fix_id.lower()]]


def explained_fix(text: str, out) -> str:
    """The id of the fix that repairs the error in ``text`` (registry/known_errors.py, which the browser extension
    and the README's troubleshooting share), after printing what went wrong to ``out``."""
    from minimax_hotfix.registry.known_errors import KNOWN_ERRORS, known_error

    entry = known_error(text, text)  # a pasted traceback holds the message too
    if entry is None:
        fixes = sorted({entry.fix for entry in KNOWN_ERRORS if any(message in text for message in entry.message)})
        if len(fixes) > 1:
            raise DoctorError(f"fixes {', '.join(fixes)} repair errors with this message; pass the whole traceback "
                              "(ComfyUI's log, or the error's details in its browser UI) to tell which")
        raise DoctorError("no MiniMax Hotfix fix is known for this error; if a MiniMax workflow shows it, report it "
                          "with the output of python tools/doctor.py --json")
    print(f"{entry.fix}: {entry.explanation} (README, Troubleshooting: \"{entry.readme}\")\n", file=out)
    return entry.fix


def run_audit(files, as_json: bool) -> int:
    try:
        audit = importlib.import_module(AUDIT_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name not in (AUDIT_MODULE, AUDIT_MODULE.rsplit(".", 1)[0]):
            raise
        raise DoctorError("the placement audit is not available in this version") from exc
    return audit.main(list(files), as_json)


def run(args) -> int:
    from minimax_hotfix.diagnostics.report import pack_release

    if args.version:
        print(f"minimax-hotfix {pack_release()}")
        return 0
    require_torch()
    from minimax_hotfix.diagnostics.comfyui_checkout import ComfyUIUnavailable, use_comfyui_checkout

    try:
        use_comfyui_checkout()
    except ComfyUIUnavailable as exc:
        raise DoctorError(str(exc)) from exc
    if args.audit is not None:
        return run_audit(args.audit, args.json)
    if args.explain is not None:
        text = sys.stdin.read() if args.explain == "-" else args.explain
        args.fix = explained_fix(text, sys.stderr if args.json else sys.stdout)
    fixes = select_fixes(args.fix)
    from minimax_hotfix.diagnostics.report import doctor_report, run_doctor

    if args.json:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON document alone
            report = doctor_report(fixes, show_progress=True)
        print(json.dumps(report, indent=2))
        return report["exit_code"]
    return run_doctor(fixes=fixes, width=shutil.get_terminal_size().columns)


def main(argv=None) -> int:
    import logging

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        return run(args)
    except DoctorError as exc:
        print(f"doctor: error: {exc}", file=sys.stderr)
        return CANNOT_RUN


if __name__ == "__main__":
    sys.exit(main())
