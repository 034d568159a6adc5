"""Terminal output of verdicts: a progress bar while cases run, then a table with the figures."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness.contracts.verdict import FAILED, PASSED, SKIPPED, Verdict

_STYLE = {PASSED: "green", FAILED: "bold red", SKIPPED: "yellow"}
_LOG_WIDTH = 180  # CI logs are not terminals: rich would fold every table to 80 columns


def make_console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=_LOG_WIDTH)


@contextmanager
def progress(console: Console, total: int, label: str) -> Iterator[Callable[[Verdict], None]]:
    """A bar on ``console``; yields the callback to call once per finished case."""
    bar = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"), console=console, transient=True,
    )
    with bar:
        task = bar.add_task(label, total=total, last="")

        def advance(verdict: Verdict) -> None:
            bar.update(task, advance=1, last=escape(f"{verdict.case_id}: {verdict.status}"))

        yield advance


def _fmt(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3e}" if value else "0"
    return "" if value is None else str(value)


def verdict_table(verdicts: Sequence[Verdict], title: str = "contract verdicts") -> Table:
    table = Table(title=title, show_lines=False)
    for column in ("case", "W", "dtype", "status", "bitwise", "max_abs", "bound / reason", "kernel", "ms"):
        table.add_column(column, overflow="fold")
    for v in verdicts:
        p = v.params
        degrees = f"{p.get('world_size', 1)}"
        if p.get("ring_degree", 1) > 1:
            degrees += f" ({p.get('ulysses_degree')}×{p.get('ring_degree')})"
        detail = v.bound if v.status == PASSED else (v.reason or "")
        if v.status == PASSED and "checks" in v.figures:
            n = v.figures["checks"]
            detail = f"{n} check{'s' if n != 1 else ''} hold{'' if n != 1 else 's'}"
        table.add_row(
            escape(v.case_id), degrees, str(p.get("dtype", "")), f"[{_STYLE[v.status]}]{v.status}[/]",
            _fmt(v.figures.get("bitwise")), _fmt(v.figures.get("max_abs")), escape(detail), escape(_fmt(v.kernel)),
            f"{v.duration_s * 1000:.0f}",
        )
    return table


def summary_line(verdicts: Sequence[Verdict], wall_s: float) -> str:
    counts = {s: sum(v.status == s for v in verdicts) for s in (PASSED, FAILED, SKIPPED)}
    return f"{counts[PASSED]} passed, {counts[FAILED]} failed, {counts[SKIPPED]} skipped in {wall_s:.1f} s"
