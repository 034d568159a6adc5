"""parity perf: the perf stage alone, as an A/B: HEAD against BASE side by side in one run, a verdict per image case."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from harness.commands._options import (
    ab_sampling,
    add_ab_sampling,
    add_baselines,
    add_cases,
    add_device,
    add_outputs,
    baselines_dir,
    cases_root,
    device,
    project,
    seconds,
)

if TYPE_CHECKING:
    from harness.targets.spec import TargetSpec

HELP = "time HEAD against BASE side by side (interleaved, paired): HEAD/BASE with an interval per figure, a verdict per case"
DESCRIPTION = """\
Time every image case (or the CASEs named) on two pipeline targets in one run: BASE and HEAD are
prepared on the same devices, warmed up, then run in pairs in ABBA order, each side started
afresh (new rank processes, a new server) at least --launches times with the pairs spread over
the launches, until each figure (e2e, parity's wall clock, each stage, each step, the step
average and median) has a verdict: HEAD/BASE with its confidence interval (per launch the
Hodges-Lehmann ratio of its pairs; over the launches their signed-rank interval, Student t when
they are too few; with --launches 1 the Wilcoxon signed-rank interval of the pairs) within
1 + tolerance (passed), beyond it (failed), or still straddling it when --max-pairs or --max-time
runs out (inconclusive: the reason gives about how many pairs would decide it at the noise seen and
the command that takes them, or, past parity's most pairs, how much the figure moves a pair here). Tolerances: the `ab` profile of the baselines' perf_baselines.json,
else 5 % for e2e, the denoising stage and the step average/median, 15 % per step, 25 % for other
stages, 10 % for parity's wall clock of the run (a command's start-up included), and at least
0.5 ms (PARITY_PERF_TOL_* override them).

BASE and HEAD are pipeline targets as --pipeline-target takes them (HEAD runs the cases that name
no target; a case naming one runs it as HEAD; `openai` with launch='CMD {port}' times two
servers), or rev:GITREV: the reference pipeline as that
commit of parity's checkout has it (e.g. `parity perf rev:main reference`).
exit codes: 0 passed, 1 HEAD slower (a regression), 2 usage or configuration error, 3 inconclusive."""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "perf", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("base", metavar="BASE", help="the pipeline target timed as the baseline side")
    parser.add_argument("head", metavar="HEAD", help="the pipeline target under test")
    parser.add_argument("ids", nargs="*", metavar="CASE", help="image cases to time (default: every image case)")
    parser.add_argument(
        "--base-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for BASE's factory (repeatable), e.g. template='...' for command",
    )
    parser.add_argument(
        "--head-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for HEAD's factory (repeatable)",
    )
    add_cases(parser)
    add_baselines(parser)
    add_device(parser)
    parser.add_argument(
        "--timeout", type=seconds, default=None, metavar="S", help="per-run timeout in seconds (default 600)"
    )
    add_ab_sampling(parser.add_argument_group("sampling"), "")
    parser.add_argument(
        "--report", type=Path, default=None, metavar="DIR", help="write results.json, junit.xml and index.html here"
    )
    add_outputs(parser)
    parser.set_defaults(run=run)


def _side(args: argparse.Namespace, name: str, given: list[str], option: str) -> TargetSpec:
    """A side with its factory arguments: its option's, else the project file's ``pipeline_target_args`` where the
    project's ``pipeline_target`` is this side's target (``parity perf command command`` in a project of commands)."""
    from harness.targets.spec import TargetSpec, parse_target_args

    p = project(args)
    if given or p is None or p.pipeline_target != name:
        return TargetSpec(name, parse_target_args(given, option))
    return p.spec_of("pipeline_target")


def run(args: argparse.Namespace) -> int:
    from harness.contracts.runner import RunOptions
    from harness.gate.run import run_gate
    from harness.gate.stage import GateOptions, PerfOptions
    from harness.results import EXIT_CODES

    perf = PerfOptions(
        enabled=True,
        base=_side(args, args.base, args.base_arg, "--base-arg"),
        sampling=ab_sampling(args, ""),
        inconclusive=args.inconclusive,
        cases=tuple(args.ids),
        ratio_contracts=False,
    )
    options = GateOptions(
        cases_root=cases_root(args),
        baselines_dir=baselines_dir(args),
        run=RunOptions(device=device(args), timeout=args.timeout),
        pipeline=_side(args, args.head, args.head_arg, "--head-arg"),
        report_dir=args.report,
        json_path=args.json,
        junit_path=args.junit,
        perf=perf,
        stages=("perf",),
        command="perf",
        project=project(args),
    )
    return EXIT_CODES[run_gate(options)["verdict"]]
