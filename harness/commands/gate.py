"""``parity gate``: the CI gate. Runs every stage, writes results JSON and JUnit XML, exits 1 on any regression.

A stage is an object with a ``name``, ``skip_reason(ctx) -> str | None`` (e.g. its cases
directory is absent) and ``run(ctx) -> StageResult``. The contract stage is here; the image
stage and the perf stage live in ``harness/stages/``; a new stage is one more entry in :data:`STAGES`. Each stage
returns JSON-safe records (its own schema) and JUnit rows; the gate merges them into one
results document (``stages.<name>``) and one JUnit file (one testsuite per stage). A stage may
also have ``preflight(ctx)``, called for every stage before any stage runs, so that a
configuration error (exit 2) in a later stage does not wait for the earlier stages' cases.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from harness.commands._options import add_baselines, add_cases, add_outputs, add_target
from harness.console import make_console
from harness.contracts.verdict import FAILED, PASSED, SKIPPED
from harness.paths import default_baselines_dir, default_cases_dir
from harness.report_junit import JUnitCase
from harness.runner import PoolSet
from harness.stages.images import ImageStage
from harness.stages.perf import PerfStage, add_perf_options

HELP = "the CI gate: contract cases, image quality against references, timings against perf baselines; exit 1 on any regression"


@dataclass
class GateContext:
    args: argparse.Namespace
    cases_root: Path
    baselines_dir: Path
    report_dir: Path | None
    out: Console
    err: Console
    pools: PoolSet  # one rank group per world size for the whole gate: stages share them


@dataclass
class StageResult:
    name: str
    records: list[dict[str, Any]]
    junit: list[JUnitCase]
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    top_level: dict[str, Any] = field(default_factory=dict)  # merged into the results document's top level

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": {PASSED: self.passed, FAILED: self.failed, SKIPPED: self.skipped},
            "wall_s": self.wall_s,
            "records": self.records,
            **self.extra,
        }


class GateStage(Protocol):
    name: str

    def skip_reason(self, ctx: GateContext) -> str | None: ...

    def run(self, ctx: GateContext) -> StageResult: ...


class ContractStage:
    """Every contract case under ``<cases>/contracts`` on the chosen target."""

    name = "contracts"

    def skip_reason(self, ctx: GateContext) -> str | None:
        return None  # no contract cases is a configuration error, raised by the loader

    def run(self, ctx: GateContext) -> StageResult:
        from harness.cases import load_cases, platform_of_device
        from harness.commands.check import run_contract_cases
        from harness.console import summary_line, verdict_table
        from harness.report_junit import junit_from_verdicts

        cases = load_cases(ctx.cases_root, platform_of_device(ctx.args.device))
        run = run_contract_cases(cases, ctx.args, ctx.err, label=self.name, pools=ctx.pools)
        verdicts = run.verdicts
        ctx.out.print(verdict_table(verdicts, title="gate: contracts"))
        ctx.out.print(f"contracts: {summary_line(verdicts, run.wall_s)}")
        count = {s: sum(v.status == s for v in verdicts) for s in (PASSED, FAILED, SKIPPED)}
        return StageResult(
            self.name, [v.to_dict() for v in verdicts], junit_from_verdicts(verdicts, self.name),
            count[PASSED], count[FAILED], count[SKIPPED], run.wall_s, extra=run.timing(),
        )


STAGES: list[GateStage] = [ContractStage(), ImageStage(), PerfStage()]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("gate", help=HELP, description=__doc__.split("\n\n")[0])
    add_cases(parser)
    add_baselines(parser)
    parser.add_argument("--report", type=Path, default=None, metavar="DIR", help="write results.json and junit.xml (and stage reports) here")
    add_target(parser)
    parser.add_argument("--clip-model", default=None, metavar="DIR",
                        help="local CLIP model directory for the image stage (default: $PARITY_CLIP_MODEL; none: clip skipped)")
    add_perf_options(parser)
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.baselines.atomic import write_json_atomic
    from harness.commands.check import environment
    from harness.errors import ConfigError
    from harness.report_junit import write_junit

    baselines = args.baselines or default_baselines_dir()
    if args.baselines is not None and not baselines.is_dir():
        raise ConfigError("no such baselines directory", path=baselines, key="--baselines")
    start = time.perf_counter()
    results: dict[str, Any] = {}
    junit: list[JUnitCase] = []
    failed = 0
    top_level: dict[str, Any] = {}
    with PoolSet(args.device) as pools:
        ctx = GateContext(
            args, args.cases or default_cases_dir(), baselines, args.report, make_console(), make_console(stderr=True), pools
        )
        for stage in STAGES:
            preflight = getattr(stage, "preflight", None)
            if preflight is not None and not stage.skip_reason(ctx):
                preflight(ctx)
        for stage in STAGES:
            reason = stage.skip_reason(ctx)
            if reason:
                results[stage.name] = {"skipped": reason}
                ctx.out.print(f"{stage.name}: skipped ({reason})")
                continue
            result = stage.run(ctx)
            results[stage.name] = result.to_dict()
            junit += result.junit
            failed += result.failed
            top_level.update(result.top_level)
    document = {
        "command": "gate",
        **environment(args),
        "wall_s": time.perf_counter() - start,
        "passed": failed == 0,
        "stages": results,
        **top_level,
    }
    json_paths = [p for p in (args.json, args.report / "results.json" if args.report else None) if p]
    junit_paths = [p for p in (args.junit, args.report / "junit.xml" if args.report else None) if p]
    for path in json_paths:
        write_json_atomic(path, document)
    for path in junit_paths:
        write_junit(path, junit, name="parity gate")
    if args.report:
        from harness.report_html import write_index

        write_index(args.report / "index.html", document)
    ctx.out.print(f"gate: {'PASSED' if failed == 0 else f'FAILED ({failed} failing cases)'}")
    return 1 if failed else 0
