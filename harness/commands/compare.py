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


def run(args: argparse.Namespace) -> int:
    from harness.files.jsonio import read_json
    from harness.report.compare import Records, Rule, check_rules, compare
    from harness.report.compare_render import comparison_json, render_comparison
    from harness.report.output import emit_json, human_console
    from harness.results import stage_records

    rules = [Rule.parse(text) for text in args.fail_on]
    docs = [(path, read_json(path)) for path in (args.base, args.new)]
    base, new = (Records(str(path), stage_records(doc, path)) for path, doc in docs)
    deltas, statuses = compare(base, new)
    broken = check_rules(deltas, rules)
    render_comparison(human_console(args.json), docs, deltas, statuses, broken, args.all)
    if args.json is not None:
        emit_json(args.json, comparison_json(args.base, args.new, deltas, statuses, broken))
    return 1 if broken else 0
