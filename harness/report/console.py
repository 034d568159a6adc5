"""Terminal output: a progress bar while cases run, then one table of results with the figures each stage shows."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness.report.format import STATUS_STYLE, figure
from harness.results import FAILED, INCONCLUSIVE, NOT_APPLICABLE, PASSED, CaseResult, verdict

_LOG_WIDTH = 180  # CI logs are not terminals: rich would fold every table to 80 columns

#: A stage's own figure columns: a header and how a result fills it.
Column = tuple[str, Callable[[CaseResult], str]]


def make_console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=_LOG_WIDTH)


WAITING = "starting the rank groups…"


@contextmanager
def progress(
    console: Console, total: int, label: str, waiting: str = WAITING
) -> Iterator[Callable[[CaseResult], None]]:
    """A bar on ``console``; yields the callback to call once per finished case.

    Until the first case finishes the bar says what it waits for (``waiting``: ranks start in
    the background and take seconds), so 0/N with a running clock does not read as a hang.
    """
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"),
        console=console,
        transient=True,
    )
    with bar:
        task = bar.add_task(label, total=total, last=escape(waiting))

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


Tables = Literal["all", "failures", "none"]  # which rows a verb's result tables show: -q none, --failures-only failures


def print_results(
    console: Console, results: Sequence[CaseResult], title: str, columns: Sequence[Column] = (), tables: Tables = "all"
) -> None:
    """A stage's result table as ``tables`` asks: every row, the failing and undecided ones, or none."""
    if tables == "none":
        return
    if tables == "failures":
        shown = [r for r in results if r.status in (FAILED, INCONCLUSIVE)]
        title = f"{title} (failures only: {len(shown)} of {len(results)})"
        if not shown:
            console.print(escape(title))
            return
        results = shown
    console.print(result_table(results, title, columns))


def result_table(results: Sequence[CaseResult], title: str, columns: Sequence[Column] = ()) -> Table:
    """case | W | status | the stage's columns | bound (passed) or reason | ms."""
    table = Table(title=escape(title))
    widest = max((len(r.case_id) for r in results), default=4)
    table.add_column("case", no_wrap=True, min_width=widest)  # an id broken over lines cannot be copied
    for header in ("W", "status", *(c[0] for c in columns), "bound / reason", "ms"):
        table.add_column(header, overflow="fold")
    for r in results:
        table.add_row(
            escape(r.case_id),
            _degrees(r),
            f"[{STATUS_STYLE[r.status]}]{r.status}[/]",
            *(escape(fill(r)) for _, fill in columns),
            escape(_detail(r)),
            f"{r.duration_s * 1000:.0f}",
        )
    return table


def text_table(
    title: str, headers: Sequence[str], rows: Iterable[Sequence[str]], no_wrap: Collection[str] = ()
) -> Table:
    """A table of plain text cells (escaped, so a case id or a path never reads as markup); long cells fold,
    those under the ``no_wrap`` headers (ids and hashes a user copies) stay on one line."""
    table = Table(title=escape(title))
    for header in headers:
        table.add_column(header, no_wrap=header in no_wrap, overflow="fold")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
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


def _not_run(results: Sequence[CaseResult]) -> str:
    return "skipped or not applicable" if any(r.status == NOT_APPLICABLE for r in results) else "skipped"


def print_verdict(
    console: Console,
    verb: str,
    stages: Mapping[str, Sequence[CaseResult]],
    report: Path | None = None,
    inconclusive_fails: bool = True,
) -> None:
    """The last lines of a run: each failing (then undecided) case with its reason and the command that shows it,
    the report page, then the verdict (:func:`harness.results.verdict`) as the very last line:
    ``gate: FAILED (2 failing cases: a, b)``, ``gate: NOTHING RAN (...)``, ``gate: INCONCLUSIVE (...)`` or
    ``gate: PASSED``."""
    listed = {
        status: [(stage, r) for stage, results in stages.items() for r in results if r.status == status]
        for status in (FAILED, INCONCLUSIVE)
    }
    for status, title in ((FAILED, "failing cases"), (INCONCLUSIVE, "inconclusive cases")):
        if listed[status]:
            console.print(f"{title} ({len(listed[status])}):")
        for stage, r in listed[status]:
            reason = (r.reason or str(status)).splitlines()[0]
            console.print(escape(f"  {stage}/{r.case_id}: {reason}"), soft_wrap=True)
            if r.next_step:
                console.print(escape(f"    -> {r.next_step}"), soft_wrap=True)
    if report is not None:
        console.print(escape(f"report: {report}"), soft_wrap=True)
    failing, undecided = listed[FAILED], listed[INCONCLUSIVE]

    def named(cases: list[tuple[str, CaseResult]], what: str) -> str:
        return f"{len(cases)} {what} case{'s' if len(cases) != 1 else ''}: {', '.join(r.case_id for _, r in cases)}"

    every = [r for results in stages.values() for r in results]
    outcome = verdict(every, inconclusive_fails)
    if outcome == "failed":
        line = f"FAILED ({named(failing, 'failing')})"
    elif outcome == "empty":
        line = (
            f"NOTHING RAN ({len(every)} case{'s' if len(every) != 1 else ''}, every one {_not_run(every)}: "
            "nothing was checked; "
            "exit 2)"
            if every
            else "NOTHING RAN (no case was selected; exit 2)"
        )
    elif outcome == "inconclusive":
        line = f"INCONCLUSIVE ({named(undecided, 'undecided')}; exit 3)"
    else:
        line = "PASSED" + (f" ({named(undecided, 'undecided')}, counted as passed)" if undecided else "")
    console.print(escape(f"{verb}: {line}"), soft_wrap=True)
