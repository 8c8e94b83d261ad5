"""The fix table the Status node shows (and the doctor prints): each fix's state (what ``detect`` found in the running
code), where it is attached (what it did to the models handed to the pack), and its reason; then when it retires."""

from __future__ import annotations

import textwrap

from ..contract import Fix, State
from . import all_fixes, attachment, broken_modules, status
from .prompt_fixing import PROMPT_FIXING
from .ray_actors import LAST_RUN


def status_rows(fixes: list[Fix] | None = None) -> list[tuple[str, str, str]]:
    """(id, state, reason) per fix; without ``fixes``, every fix and every fix module that failed to import."""
    rows = []
    for fix in all_fixes().values() if fixes is None else fixes:
        found = status(fix)  # once: a provisional status may change between two calls
        rows.append((fix.id, found.state.value, found.reason))
    if fixes is None:
        rows += [(name, State.FAILED.value, f"module failed to import: {err}") for name, err in broken_modules().items()]
    return rows


def retirement_rows(fixes: list[Fix] | None = None) -> list[tuple[str, str, str]]:
    """(id, upstream change that fixes it, condition for deleting its file) per fix."""
    return [(fix.id, fix.retirement.fixed_by, fix.retirement.delete_when)
            for fix in (all_fixes().values() if fixes is None else fixes)]


def text_table(rows, headers=None, width: int | None = None) -> str:
    """Columns padded to their widest cell; with ``width``, the last column wraps to fit it."""
    rows = [tuple(map(str, row)) for row in rows]
    shown = [*([tuple(headers)] if headers else []), *rows]
    widths = [max(len(row[i]) for row in shown) for i in range(len(rows[0]))]
    lead = sum(widths[:-1]) + 2 * (len(widths) - 1)
    last = max(width - lead, 20) if width else None
    if last:
        widths[-1] = min(widths[-1], last)

    def lines(row):
        first = "".join(cell.ljust(w) + "  " for cell, w in zip(row[:-1], widths, strict=False))
        parts = (textwrap.wrap(row[-1], last, break_on_hyphens=False) if last else [row[-1]]) or [""]
        return [((first if i == 0 else " " * len(first)) + part).rstrip() for i, part in enumerate(parts)]

    head = [*lines(headers), "  ".join("-" * w for w in widths)] if headers else []
    return "\n".join([*head, *(line for row in rows for line in lines(row))])


def attachment_texts(fixes: list[Fix] | None = None) -> dict[str, str]:
    """Per fix id, where it is attached now (``registry.attachment``), as the table says it."""
    return {fix.id: str(attachment(fix)) for fix in (all_fixes().values() if fixes is None else fixes)}


def machine_rows(fixes: list[Fix] | None = None) -> list[tuple[str, str]]:
    """(id, line) per line a needed fix has to say about this machine (``Fix.machine_lines``)."""
    rows = []
    for fix in all_fixes().values() if fixes is None else fixes:
        if status(fix).state is State.NEEDED:
            rows += [(fix.id, line) for line in fix.machine_lines()]
    return rows


def status_table(width: int | None = None, fixes: list[Fix] | None = None) -> str:
    """The states and attachments, then each fix's retirement: which upstream change makes it obsolete and when its
    file goes."""
    rows = status_rows(fixes)
    if not rows:
        return "No fix is registered yet."
    attached = attachment_texts(fixes)
    retiring = [(fix_id, f"fixed by: {fixed_by}; delete when: {delete_when}")
                for fix_id, fixed_by, delete_when in retirement_rows(fixes)]
    table = text_table([(fix_id, state, attached.get(fix_id, "-"), reason) for fix_id, state, reason in rows],
                       ("fix", "state", "attached", "reason"), width)
    table += "\n\n" + text_table([("server-side fixing", PROMPT_FIXING.describe()),
                                   ("raylight (multi-GPU)", LAST_RUN.describe())], width=width)
    machine = machine_rows(fixes)
    if machine:
        table += "\n\n" + text_table(machine, ("fix", "on this machine"), width)
    return table + ("\n\n" + text_table(retiring, ("fix", "retirement"), width) if retiring else "")
