"""How ``parity compare`` shows a comparison: the two runs' provenance, a table of figures, status changes, the
rules broken, and the same as a JSON document (the verb only parses, compares and calls these)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.report.compare import Delta, Rule, StatusChange
from harness.report.format import figure, inert
from harness.results import json_safe

COLUMNS = ("stage", "case", "figure", "old", "new", "change")


def _safe(text: object) -> str:
    """Text read from the files: inert in the terminal, literal to rich."""
    return escape(inert(text))


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}%"


def _new(value: float | None) -> str:
    """The new value of a figure; one the new run does not have is missing (and worse than any value)."""
    return "missing" if value is None else figure(value)


def _provenance(label: str, doc: Mapping[str, Any], path: Path) -> str:
    git = doc.get("git") or {}
    commit = (
        f"commit {str(git['commit'])[:12]}{' (dirty)' if git.get('dirty') else ''}"
        if git.get("commit")
        else "no commit recorded"
    )
    return f"{label}: {path} ({commit}, parity {doc.get('parity_version', '?')}, torch {doc.get('torch', '?')})"


def _table(deltas: Sequence[Delta], bad: set[int], show_all: bool) -> Table:
    table = Table(title="figures" + ("" if show_all else " that changed"))
    for column in COLUMNS:
        table.add_column(
            column, no_wrap=column == "case", justify="right" if column in ("old", "new", "change") else "left"
        )
    for d in (d for d in deltas if show_all or d.old != d.new):
        style = "bold red" if id(d) in bad else ("yellow" if d.worse else "")
        change = f"[{style}]{_pct(d.change_pct)}[/]" if style else _pct(d.change_pct)
        table.add_row(_safe(d.stage), _safe(d.case_id), _safe(d.metric), figure(d.old), _new(d.new), change)
    return table


def render_comparison(
    out: Console,
    docs: Sequence[tuple[Path, Mapping[str, Any]]],
    deltas: Sequence[Delta],
    statuses: Sequence[StatusChange],
    broken: Sequence[tuple[Rule, Delta]],
    show_all: bool,
) -> None:
    """The comparison in the terminal: BASE's and NEW's provenance, the figures, the status changes, the rules."""
    for label, (path, doc) in zip(("base", "new"), docs):
        out.print(_safe(_provenance(label, doc, path)), soft_wrap=True)
    out.print(_table(deltas, {id(d) for _, d in broken}, show_all))
    for s in statuses:
        out.print(_safe(f"{s.stage}/{s.case_id}: {s.old or 'absent'} -> {s.new or 'absent'}"), soft_wrap=True)
    for rule, d in broken:
        worse = (
            f"{figure(d.old)} -> {_new(d.new)} ({_pct(d.change_pct)}), worse than --fail-on {rule.metric}:{rule.pct:g}"
        )
        out.print(_safe(f"FAIL {d.stage}/{d.case_id} {d.metric}: {worse}"), soft_wrap=True)
    changed = sum(d.old != d.new for d in deltas)
    out.print(
        f"{len(deltas)} figures compared, {changed} changed, {sum(d.worse for d in deltas)} worse, "
        f"{len(broken)} past a --fail-on threshold; {len(statuses)} status change(s)"
    )


def comparison_json(
    base: Path,
    new: Path,
    deltas: Sequence[Delta],
    statuses: Sequence[StatusChange],
    broken: Sequence[tuple[Rule, Delta]],
) -> dict[str, Any]:
    """The comparison as ``--json`` writes it: every compared figure, the status changes, whether it passed."""
    bad = {id(d) for _, d in broken}
    figures = [
        {
            "stage": d.stage,
            "case_id": d.case_id,
            "figure": d.metric,
            "old": d.old,
            "new": d.new,
            "change_pct": d.change_pct,
            "worse": d.worse,
            "failed": id(d) in bad,
        }
        for d in deltas
    ]
    document = {"base": str(base), "new": str(new), "figures": figures}
    return json_safe({**document, "status_changes": [vars(s) for s in statuses], "passed": not broken})
