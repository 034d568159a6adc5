"""``parity check``'s run: the selected contract cases in rank pools opened here, their table, the results document
and JUnit where asked, the verdict (the verb parses and selects; this runs and renders, as :mod:`harness.gate.run`
does for the gate)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from harness.contracts.case import Case
from harness.contracts.runner import RunOptions
from harness.gate.contracts import run_contract_cases
from harness.ranks import PoolSet
from harness.report.console import CONTRACT_COLUMNS, Tables, make_console, print_results, print_verdict
from harness.report.junit import write_junit
from harness.report.output import JsonTarget, emit_json, human_console
from harness.results import EXIT_CODES, CaseResult, StageResult, environment, results_document, summary_line, verdict


@dataclass(frozen=True)
class CheckOutputs:
    """Where ``parity check`` writes besides the terminal, and how its tables print."""

    json: JsonTarget | None = None
    junit: Path | None = None
    tables: Tables = "all"
    project_file: Path | None = None


def run_check(cases: list[Case], options: RunOptions, outputs: CheckOutputs) -> int:
    """Run ``cases``, print and write what was found; the exit code of the verdict."""
    out = human_console(outputs.json)
    with PoolSet(options.device) as pools:
        stage = run_contract_cases(cases, options, pools, make_console(stderr=True), release_pools=True)
    _print_stage(out, stage, outputs.tables)
    if outputs.json is not None:
        where = environment(options.target, options.device, options.load().version(), outputs.project_file)
        emit_json(outputs.json, results_document("check", where, {"contracts": stage}, stage.wall_s))
    if outputs.junit:
        write_junit(outputs.junit, {"contracts": stage.results})
    print_verdict(out, "check", {"contracts": stage.results})
    return EXIT_CODES[verdict(stage.results)]


def _print_stage(out: Console, stage: StageResult, tables: Tables) -> None:
    results: list[CaseResult] = stage.results
    print_results(out, results, "contract results", CONTRACT_COLUMNS, tables)
    out.print(summary_line(results, stage.wall_s))
    starts = ", ".join(f"W={w} {t:.1f} s" for w, t in stage.extra["pool_startup_s"].items())
    out.print(f"cases {stage.extra['cases_s']:.1f} s; rank groups started in the background ({starts or 'none'})")
    for r in results:
        if r.traceback and r.status == "failed":
            print(f"\n--- {r.case_id}: {r.reason}\n{r.traceback}", file=sys.stderr)
