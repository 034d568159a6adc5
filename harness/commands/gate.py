"""parity gate: the CI gate. Runs every stage, writes results JSON, JUnit XML and an HTML report, exits 1 on any regression."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from harness.commands._options import (
    add_baselines, add_cases, add_outputs, add_pipeline_target, add_target, baselines_dir, cases_root, pipeline_args, run_options,
)

HELP = "the CI gate: contract cases, image quality against references, timings against perf baselines; exit 1 on any regression"
DESCRIPTION = "The CI gate: every contract case, every image case against its reference and thresholds, and (where this machine has a perf baseline) the timings."


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    from harness.gate.stage import PERF_PROFILES, PerfOptions

    parser = sub.add_parser("gate", help=HELP, description=DESCRIPTION)
    add_cases(parser)
    add_baselines(parser)
    parser.add_argument("--report", type=Path, default=None, metavar="DIR",
                        help="write results.json, junit.xml, index.html, a triptych PNG and the candidate of every failing image case here")
    add_target(parser)
    add_pipeline_target(parser, "of the image and perf stages")
    parser.add_argument("--clip-model", default=None, metavar="DIR",
                        help="local CLIP model directory for the image stage (default: $PARITY_CLIP_MODEL; none: clip skipped)")
    defaults = PerfOptions()
    group = parser.add_argument_group("perf stage (timings of the image cases)")
    group.add_argument("--perf", action=argparse.BooleanOptionalAction, default=None,
                       help="time the image cases against this machine's perf baseline (default: on only where one "
                       "exists, baselines/platforms/perf/<platform>.json; --perf without one measures for recalibration)")
    group.add_argument("--perf-runs", type=_count(1), default=defaults.runs, metavar="N",
                       help=f"timed runs per case; their median is checked (default {defaults.runs})")
    group.add_argument("--perf-warmup", type=_count(0), default=defaults.warmup, metavar="N",
                       help=f"untimed warm-up runs per case (default {defaults.warmup})")
    group.add_argument("--perf-profile", default=defaults.profile, choices=PERF_PROFILES,
                       help="tolerance profile (default: normalised where the baseline has a calibration, else pr_test)")
    parser.add_argument("--keep-outputs", action="store_true",
                        help="with --report: save every image case's candidate in DIR/candidates (failing ones are always "
                        "saved), for the report and for `parity bless --from-results DIR`")
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.errors import ConfigError
    from harness.gate.run import run_gate
    from harness.gate.stage import GateOptions, PerfOptions

    baselines = baselines_dir(args)  # run_gate refuses one that is not a directory
    if args.keep_outputs and args.report is None:
        raise ConfigError("--keep-outputs saves into the report directory: pass --report DIR too", key="--keep-outputs")
    options = GateOptions(
        cases_root(args), baselines, run_options(args), args.pipeline_target, args.report, args.json, args.junit,
        args.clip_model, PerfOptions(args.perf, args.perf_runs, args.perf_warmup, args.perf_profile), args.keep_outputs,
        pipeline_args(args),
    )
    return 0 if run_gate(options)["passed"] else 1
