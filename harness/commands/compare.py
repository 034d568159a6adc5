"""parity compare: two results files side by side, per case and figure old, new and % change; exit 1 past --fail-on."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.commands._options import add_json

HELP = (
    "compare two results files: per case and figure old, new and percent change; --fail-on METRIC:PCT exits 1 past it"
)
DESCRIPTION = """\
Compare two results files of `parity gate` or `parity check` (BASE first): for every case and
every numeric figure the old value, the new one and the % change, (new - old) / |old|. clip, ssim
and psnr are better higher, every other figure (max_abs, e2e_ms, ...) better lower. Status changes
(passed -> failed) are listed too. Only changed figures are shown unless --all."""
EPILOG = """\
examples:
  parity compare main/results.json pr/results.json --fail-on e2e_ms:10 --fail-on psnr:1
exit codes: 0 no --fail-on threshold passed; 1 a figure got worse past one; 2 a bad file or argument.
A figure that got worse from 0 or from inf (bitwise broke, identical images differ), that became
nan, or that the new file no longer has, has no percentage and fails every --fail-on rule on it,
whatever PCT."""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "compare",
        help=HELP,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("base", type=Path, metavar="BASE.json", help="the results to compare against")
    parser.add_argument("new", type=Path, metavar="NEW.json", help="the results to judge")
    parser.add_argument(
        "--fail-on",
        action="append",
        default=[],
        metavar="METRIC:PCT",
        help="exit 1 when METRIC got worse by more than PCT percent in any case (repeatable)",
    )
    parser.add_argument("--all", action="store_true", help="show unchanged figures too")
    add_json(parser, "every compared figure")
    parser.set_defaults(run=run)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}%"


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from harness.files.jsonio import read_json
    from harness.report.compare import Records, Rule, check_rules, compare
    from harness.report.format import figure, inert
    from harness.report.output import emit_json, human_console
    from harness.results import json_safe, stage_records

    def safe(text: object) -> str:  # text read from the files: inert in the terminal, literal to rich
        return escape(inert(text))

    rules = [Rule.parse(text) for text in args.fail_on]
    docs = [read_json(p) for p in (args.base, args.new)]
    base, new = (Records(str(path), stage_records(doc, path)) for doc, path in zip(docs, (args.base, args.new)))
    deltas, statuses = compare(base, new)
    broken = check_rules(deltas, rules)
    out = human_console(args.json)
    for label, doc, path in (("base", docs[0], args.base), ("new", docs[1], args.new)):
        git = doc.get("git") or {}
        commit = (
            f"commit {str(git['commit'])[:12]}{' (dirty)' if git.get('dirty') else ''}"
            if git.get("commit")
            else "no commit recorded"
        )
        out.print(
            safe(f"{label}: {path} ({commit}, parity {doc.get('parity_version', '?')}, torch {doc.get('torch', '?')})"),
            soft_wrap=True,
        )
    bad = {id(d) for _, d in broken}
    table = Table(title="figures" + ("" if args.all else " that changed"))
    for column in ("stage", "case", "figure", "old", "new", "change"):
        table.add_column(
            column, no_wrap=column == "case", justify="right" if column in ("old", "new", "change") else "left"
        )
    shown = [d for d in deltas if args.all or d.old != d.new]
    for d in shown:
        style = "bold red" if id(d) in bad else ("yellow" if d.worse else "")
        table.add_row(
            safe(d.stage),
            safe(d.case_id),
            safe(d.metric),
            figure(d.old),
            _new(d.new),
            f"[{style}]{_pct(d.change_pct)}[/]" if style else _pct(d.change_pct),
        )
    out.print(table)
    for s in statuses:
        out.print(safe(f"{s.stage}/{s.case_id}: {s.old or 'absent'} -> {s.new or 'absent'}"), soft_wrap=True)
    for rule, d in broken:
        out.print(
            safe(
                f"FAIL {d.stage}/{d.case_id} {d.metric}: {figure(d.old)} -> {_new(d.new)} "
                f"({_pct(d.change_pct)}), worse than --fail-on {rule.metric}:{rule.pct:g}"
            ),
            soft_wrap=True,
        )
    changed = sum(d.old != d.new for d in deltas)
    out.print(
        f"{len(deltas)} figures compared, {changed} changed, {sum(d.worse for d in deltas)} worse, "
        f"{len(broken)} past a --fail-on threshold; {len(statuses)} status change(s)"
    )
    if args.json is not None:
        emit_json(
            args.json,
            json_safe(
                {
                    "base": str(args.base),
                    "new": str(args.new),
                    "figures": [
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
                    ],
                    "status_changes": [vars(s) for s in statuses],
                    "passed": not broken,
                }
            ),
        )
    return 1 if broken else 0


def _new(value: float | None) -> str:
    """The new value of a figure; one the new run does not have is missing (and worse than any value)."""
    from harness.report.format import figure

    return "missing" if value is None else figure(value)
