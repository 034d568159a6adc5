"""``parity matrix``: merge sweep files from several machines, or results of several targets, into one table."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "merge sweep files (machines) or check results (targets: the cross-stack matrix) into one markdown or HTML table"
EPILOG = """\
Sweep files (`parity sweep --json`) give rows contract · dtype and columns platform · backend.
Results files (`parity check --json`, one per target) give the cross-stack matrix: rows are the
contract cases, columns the targets with their versions. All files must be of one kind."""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "matrix", help=HELP, description=HELP, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="sweep files or results files")
    parser.add_argument(
        "--format", choices=("markdown", "html"), default="markdown", help="output format (default: markdown)"
    )
    parser.add_argument("--output", "-o", type=Path, default=None, metavar="FILE", help="write here instead of stdout")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.errors import ConfigError
    from harness.files.atomic import check_writable, write_bytes_atomic
    from harness.files.jsonio import read_json
    from harness.report.format import inert_lines
    from harness.sweep import matrix, stacks

    if args.output:
        check_writable(args.output, "--output")
    kinds = {path: stacks.is_results_document(read_json(path)) for path in args.files}
    if len(set(kinds.values())) > 1:
        mixed = ", ".join(f"{p} ({'results' if k else 'sweep'})" for p, k in kinds.items())
        raise ConfigError(f"give sweep files or results files, not both: {mixed}", key="FILE")
    if all(kinds.values()):
        runs = [stacks.load_stack_run(f) for f in args.files]
        text = stacks.render_html(runs) if args.format == "html" else stacks.render_markdown(runs)
    else:
        sweeps = [matrix.load_sweep(f) for f in args.files]
        text = matrix.render_html(sweeps) if args.format == "html" else matrix.render_markdown(sweeps)
    text = inert_lines(text)  # labels come from other machines' files: no escape sequence reaches a terminal
    if args.output:
        write_bytes_atomic(args.output, text.encode())
    else:
        print(text, end="")
    return 0
