"""Print docs/cli-options.md: every verb's ``parity VERB --help``, at 100 columns, paths made neutral.

    python scripts/cli_reference.py > docs/cli-options.md

``tests/cli/test_cli_reference.py`` renders it again and fails when the page is stale.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH = "100"

HEADER = """\
# `parity` options, verb by verb

Generated from `parity VERB --help` by `python scripts/cli_reference.py > docs/cli-options.md`
(a test fails when it is stale); `<parity>` stands for parity's checkout or installed data. What
each verb is for, exit codes and the `--json` convention: [cli.md](cli.md).
"""


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers here, with no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _section(title: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    text = parser.format_help().replace(str(ROOT), "<parity>").rstrip()
    lines = [f"{'#' * level} `{title}`", "", "```text", text, "```", ""]
    for name, child in _subcommands(parser).items():
        lines += _section(f"{title} {name}", child, level + 1)
    return lines


def render() -> str:
    os.environ["COLUMNS"] = WIDTH  # argparse wraps at the terminal's width: one width for every machine
    os.environ.pop("FORCE_COLOR", None)
    sys.path.insert(0, str(ROOT))
    from harness.cli import build_parser

    lines = [HEADER]
    for verb, parser in _subcommands(build_parser()).items():
        lines += _section(f"parity {verb}", parser, 2)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
