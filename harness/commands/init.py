"""parity init: a project in a repository of one's own (project file, example cases, empty baselines)."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "write a project (parity.toml, example cases, empty baselines) into DIR, so every write stays in it"
DESCRIPTION = """\
Write a parity project into DIR (default: the working directory): parity.toml, an example contract
case (parity/cases/contracts) and image case (parity/cases/images), and empty baselines in sglang's
schemas (parity/baselines/consistency_threshold.json, perf_baselines.json). Every verb run in DIR
or below then reads its cases from there and writes its baselines there. Nothing is overwritten:
if a file exists already, nothing is written. Prints the next commands to run."""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "init", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "dir", nargs="?", type=Path, default=Path("."), metavar="DIR", help="the project's root (default: .)"
    )
    parser.add_argument("--images-only", action="store_true", help="no contract case: a project that gates images only")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.project.skeleton import describe, write_skeleton

    for line in describe(write_skeleton(args.dir, args.images_only)):
        print(line)
    return 0
