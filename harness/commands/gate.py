"""parity gate: the CI gate. Runs every stage, writes results JSON, JUnit XML and an HTML report; exit 1 on any regression."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.commands._options import (
    ab_sampling,
    add_ab_sampling,
    add_baselines,
    add_cases,
    add_outputs,
    add_pipeline_target,
    add_tables,
    add_target,
    baselines_dir,
    cases_root,
    count,
    perf_profile,
    pipeline_target,
    project,
    run_options,
)

HELP = (
    "the CI gate: contract cases, image quality against references, timings (HEAD against BASE, or a stored baseline)"
)
DESCRIPTION = """\
The CI gate: every contract case, every image case against its reference and thresholds, and the
timings of the image cases: with --perf-base SPEC, the cases' pipeline (HEAD) against SPEC (BASE)
side by side in this run, a ratio with a confidence interval per figure; otherwise, where this
machine has a stored perf baseline, raw timings against it.
exit codes: 0 passed, 1 a failure or regression, 2 usage or configuration error, 3 inconclusive
(a timing the runs could not decide, nothing failed; --perf-inconclusive pass makes it 0)."""


# long: argparse, the gate's options in the order --help prints them
def register(sub: argparse._SubParsersAction) -> None:
    from harness.gate.stage import PERF_PROFILES, PerfOptions

    parser = sub.add_parser(
        "gate", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_cases(parser)
    add_baselines(parser)
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="DIR",
        help="write results.json, junit.xml, index.html, a triptych PNG and the candidate of every failing image case here",
    )
    add_target(parser)
    add_pipeline_target(parser, "of the image and perf stages")
    parser.add_argument(
        "--clip-model",
        default=None,
        metavar="DIR",
        help="local CLIP model directory for the image stage (default: $PARITY_CLIP_MODEL; none: clip skipped)",
    )
    defaults = PerfOptions()
    group = parser.add_argument_group("perf stage (timings of the image cases)")
    group.add_argument(
        "--perf",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the image cases (default: on with --perf-base, else only where this machine has a stored "
        "baseline, baselines/platforms/perf/<platform>.json; --perf without either measures for recalibration)",
    )
    group.add_argument(
        "--perf-base",
        default=None,
        metavar="SPEC",
        help="A/B: the BASE pipeline target each image case's own pipeline (HEAD) is timed against, side by "
        "side: a built-in name, module:factory, or rev:GITREV (the reference pipeline at that commit)",
    )
    group.add_argument(
        "--perf-base-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the BASE target's factory (repeatable)",
    )
    add_ab_sampling(group, "perf-")
    group.add_argument(
        "--perf-runs",
        type=count(1),
        default=defaults.runs,
        metavar="N",
        help=f"absolute: timed runs per case; their medians are checked (default {defaults.runs})",
    )
    group.add_argument(
        "--perf-profile",
        default=defaults.profile,
        choices=PERF_PROFILES,
        help="absolute: the stored baseline's tolerance profile (default: the project file's, else pr_test)",
    )
    parser.add_argument(
        "--keep-outputs",
        action="store_true",
        help="with --report: save every image case's candidate in DIR/candidates (failing ones are always "
        "saved), for the report and for `parity bless --from-results DIR`",
    )
    add_outputs(parser)
    add_tables(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.errors import ConfigError
    from harness.gate.run import run_gate
    from harness.gate.stage import GateOptions, PerfOptions
    from harness.results import EXIT_CODES
    from harness.targets.spec import TargetSpec, parse_target_args

    baselines = baselines_dir(args)  # run_gate refuses one that is not a directory
    if args.keep_outputs and args.report is None:
        raise ConfigError("--keep-outputs saves into the report directory: pass --report DIR too", key="--keep-outputs")
    base_args = parse_target_args(args.perf_base_arg, "--perf-base-arg")
    if base_args and args.perf_base is None:
        raise ConfigError("--perf-base-arg needs --perf-base SPEC", key="--perf-base-arg")
    perf = PerfOptions(
        enabled=args.perf,
        runs=args.perf_runs,
        profile=perf_profile(args.perf_profile, args),
        base=TargetSpec(args.perf_base, base_args) if args.perf_base is not None else None,
        sampling=ab_sampling(args, "perf-"),
        inconclusive=args.perf_inconclusive,
    )
    options = GateOptions(
        cases_root=cases_root(args),
        baselines_dir=baselines,
        run=run_options(args),
        pipeline=pipeline_target(args),
        report_dir=args.report,
        json_path=args.json,
        junit_path=args.junit,
        clip_model=args.clip_model,
        perf=perf,
        keep_outputs=args.keep_outputs,
        project=project(args),
        tables=args.tables,
    )
    return EXIT_CODES[run_gate(options)["verdict"]]
