"""The gate's contract stage: every contract case on the chosen target (also all that ``parity check`` runs)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from harness.cases.contract import load_cases, platform_of_device
from harness.cases.image import is_image_only
from harness.contracts.case import Case
from harness.contracts.runner import RunOptions, check_device, run_cases, validate_for_target
from harness.gate.stage import GateContext, GateOptions
from harness.project.hints import command
from harness.ranks import PoolSet
from harness.report.console import CONTRACT_COLUMNS, print_results, progress
from harness.results import FAILED, StageResult, summary_line


def load_contract_cases(cases_root: Path, options: RunOptions) -> list[Case]:
    """The contract cases as they run for ``options``: with this platform's and this target's overlays."""
    target = options.load()
    runs = target.unavailable_reason(options.device) is None
    return load_cases(cases_root, platform_of_device(options.device), target.overlay or target.name, runs)


def run_contract_cases(
    cases: Sequence[Case],
    options: RunOptions,
    pools: PoolSet,
    err: Console,
    name: str = "contracts",
    release_pools: bool = False,
) -> StageResult:
    """Run ``cases`` with a progress bar on ``err``; the stage's results with its timing in ``extra``."""
    check_device(options.device)
    start = time.perf_counter()
    with progress(err, len(cases), name) as advance:
        results = run_cases(cases, options, pools, release_pools=release_pools, on_result=advance)
    wall = time.perf_counter() - start
    timing = {"cases_s": sum(r.duration_s for r in results), "pool_startup_s": dict(sorted(pools.startup_s.items()))}
    return StageResult(name, results, wall, extra=timing)


def check_command(case_id: str, options: GateOptions) -> str:
    """The ``parity check`` command line that runs one case again as this run did (figures, traceback)."""
    return command(["check", case_id], options.carried(target=True, baselines=False))


class ContractStage:
    """Every contract case under ``<cases>/contracts`` on the chosen target."""

    name = "contracts"

    def skip_reason(self, ctx: GateContext) -> str | None:
        """An image-only cases root (images/, no contracts/) has no contract stage; any other root without
        contract cases is a configuration error, raised by the loader."""
        root = Path(ctx.options.cases_root)
        return f"no contract cases ({root / 'contracts'} does not exist)" if is_image_only(root) else None

    def preflight(self, ctx: GateContext) -> list[Case]:
        cases = load_contract_cases(ctx.options.cases_root, ctx.options.run)
        validate_for_target(cases, ctx.options.run.usable())
        return cases

    def run(self, ctx: GateContext, cases: list[Case]) -> StageResult:
        stage = run_contract_cases(cases, ctx.options.run, ctx.pools, ctx.err, self.name)
        for result in stage.results:
            if result.status == FAILED:
                result.next_step = check_command(result.case_id, ctx.options)
        print_results(ctx.out, stage.results, "gate: contracts", CONTRACT_COLUMNS, ctx.options.tables)
        ctx.out.print(f"contracts: {summary_line(stage.results, stage.wall_s)}")
        return stage
