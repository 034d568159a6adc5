"""Options several verbs share, declared once so they read the same everywhere."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.paths import default_baselines_dir, default_cases_dir


def add_cases(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases", type=Path, default=None, metavar="DIR",
        help="cases root (its contracts/ subdirectory holds the contract case files) or a directory of "
        f"*.toml contract case files (default: {default_cases_dir()})",
    )


def add_baselines(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baselines", type=Path, default=None, metavar="DIR", help=f"baselines directory (default: {default_baselines_dir()})")


def add_outputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results (every figure) as JSON")
    parser.add_argument("--junit", type=Path, default=None, metavar="FILE", help="write JUnit XML for CI")


def add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default="reference", metavar="T",
        help="implementation under test: reference (default), sglang, yunchang, yunchang-ulysses, or module:factory",
    )
    parser.add_argument(
        "--target-arg", action="append", default=[], metavar="KEY=VALUE",
        help="keyword argument for the target's factory (repeatable), e.g. --target sglang --target-arg layer=MODULE:CLASS",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="device of the ranks (default: cpu)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="per-case timeout (default: the contract's)")
