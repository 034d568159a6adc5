"""Terminal output: a progress bar while cases run, then one table of results with the figures each stage shows."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness.report.format import STATUS_STYLE, figure
from harness.results import PASSED, CaseResult

_LOG_WIDTH = 180  # CI logs are not terminals: rich would fold every table to 80 columns

#: A stage's own figure columns: a header and how a result fills it.
Column = tuple[str, Callable[[CaseResult], str]]


def make_console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=_LOG_WIDTH)


@contextmanager
def progress(console: Console, total: int, label: str) -> Iterator[Callable[[CaseResult], None]]:
    """A bar on ``console``; yields the callback to call once per finished case."""
    bar = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"), console=console, transient=True,
    )
    with bar:
        task = bar.add_task(label, total=total, last="")

        def advance(result: CaseResult) -> None:
            bar.update(task, advance=1, last=escape(f"{result.case_id}: {result.status}"))

        yield advance


def _degrees(result: CaseResult) -> str:
    p = result.params
    text = str(p.get("world_size", 1))
    if p.get("ring_degree", 1) > 1:
        text += f" ({p.get('ulysses_degree')}×{p.get('ring_degree')})"
    return text


def _detail(result: CaseResult) -> str:
    if result.status != PASSED:
        return result.reason or ""
    checks = result.figures.get("checks")
    if isinstance(checks, int):
        return f"{checks} check{'s' if checks != 1 else ''} hold{'' if checks != 1 else 's'}"
    return result.bound


def result_table(results: Sequence[CaseResult], title: str, columns: Sequence[Column] = ()) -> Table:
    """case | W | status | the stage's columns | bound (passed) or reason | ms."""
    table = Table(title=escape(title))
    for header in ("case", "W", "status", *(c[0] for c in columns), "bound / reason", "ms"):
        table.add_column(header, overflow="fold")
    for r in results:
        table.add_row(
            escape(r.case_id), _degrees(r), f"[{STATUS_STYLE[r.status]}]{r.status}[/]",
            *(escape(fill(r)) for _, fill in columns), escape(_detail(r)), f"{r.duration_s * 1000:.0f}",
        )
    return table


def figure_column(header: str, key: str) -> Column:
    """A column showing ``figures[key]``."""
    return header, lambda r: figure(r.figures.get(key))


CONTRACT_COLUMNS: tuple[Column, ...] = (
    ("dtype", lambda r: str(r.params.get("dtype", ""))),
    figure_column("bitwise", "bitwise"),
    figure_column("max_abs", "max_abs"),
    ("kernel", lambda r: r.kernel or ""),
)
