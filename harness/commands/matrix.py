"""``parity matrix``: merge sweep files from several machines into one table."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "merge sweep JSON files from several machines into one markdown or HTML matrix"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("matrix", help=HELP, description=HELP)
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="sweep files written by `parity sweep`")
    parser.add_argument("--format", choices=("markdown", "html"), default="markdown", help="output format (default: markdown)")
    parser.add_argument("--output", "-o", type=Path, default=None, metavar="FILE", help="write here instead of stdout")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.files.atomic import check_writable, write_bytes_atomic
    from harness.sweep.matrix import load_sweep, render_html, render_markdown

    if args.output:
        check_writable(args.output, "--output")
    sweeps = [load_sweep(f) for f in args.files]
    text = render_html(sweeps) if args.format == "html" else render_markdown(sweeps)
    if args.output:
        write_bytes_atomic(args.output, text.encode())
    else:
        print(text, end="")
    return 0
