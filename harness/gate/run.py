"""The gate: run every stage in one set of rank pools, write results JSON, JUnit XML and the HTML report.

A new stage is one more entry in :data:`STAGES` (see :mod:`harness.gate.stage` for the protocol).
Each stage's preflight runs before any stage does, so a configuration error (exit 2) in a
later stage does not wait for the earlier stages' cases.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console

from harness.contracts.runner import check_device
from harness.gate.contracts import ContractStage
from harness.gate.images import ImageStage
from harness.gate.perf import PerfStage
from harness.gate.stage import GateContext, GateOptions, Stage
from harness.ranks import PoolSet
from harness.report.console import make_console, print_verdict
from harness.report.output import check_outputs, emit_json, human_console
from harness.results import StageResult, environment, results_document, write_results
from harness.targets.loader import stop_pipeline_targets


def stages() -> list[Stage[Any]]:
    """The gate's stages, in the order they run."""
    return [ContractStage(), ImageStage(), PerfStage()]


@contextlib.contextmanager
def _stopping_pipelines() -> Iterator[None]:
    """Servers the pipeline targets launched end with the run, whatever ends it."""
    try:
        yield
    finally:
        stop_pipeline_targets()


def _check_inputs(options: GateOptions) -> None:
    """Everything a run needs, checked before any stage starts: a ConfigError (exit 2) names the option."""
    from harness.baselines.tolerances import check_env_tolerances
    from harness.errors import ConfigError
    from harness.files.atomic import check_writable

    perf_ab_only = options.stages == ("perf",) and options.perf.base is not None  # reads no baseline it needs
    if not perf_ab_only and not options.baselines_dir.is_dir():
        raise ConfigError("no such baselines directory", path=options.baselines_dir, key="--baselines")
    check_device(options.run.device)
    check_env_tolerances()  # even when perf is skipped: a lane's bad override is a configuration error
    check_outputs((options.json_path, "--json"), (options.junit_path, "--junit"))
    if options.report_dir is not None:
        check_writable(options.report_dir, "--report", directory=True)


def _run_stages(options: GateOptions, out: Console) -> dict[str, StageResult | str]:
    """Each selected stage's result, or why it was skipped; every stage's preflight runs before the first stage."""
    outcome: dict[str, StageResult | str] = {}
    with PoolSet(options.run.device) as pools, _stopping_pipelines():
        ctx = GateContext(options, out, make_console(stderr=True), pools)
        plan = [
            (stage, stage.skip_reason(ctx)) for stage in stages() if not options.stages or stage.name in options.stages
        ]
        planned = {stage.name: stage.preflight(ctx) for stage, reason in plan if not reason}
        for stage, reason in plan:
            if reason:
                outcome[stage.name] = reason
                out.print(f"{stage.name}: skipped ({reason})")
            else:
                outcome[stage.name] = stage.run(ctx, planned[stage.name])
    return outcome


def run_gate(options: GateOptions) -> dict[str, Any]:
    """Run the gate; returns the results document (``passed`` says whether anything regressed)."""
    _check_inputs(options)
    start = time.perf_counter()
    out = human_console(options.json_path)
    if options.project is not None:
        out.print(
            f"project {options.project.file}: cases {options.cases_root}, baselines {options.baselines_dir}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    outcome = _run_stages(options, out)
    inconclusive_fails = options.perf.inconclusive == "fail"
    project = options.project.file if options.project else None
    document = results_document(
        options.command,
        environment(options.recorded_target(), options.run.device, options.run.load().version(), project),
        outcome,
        time.perf_counter() - start,
        inconclusive_fails,
    )
    results = {n: s.results for n, s in outcome.items() if isinstance(s, StageResult)}
    write_reports(options, document, results)
    report = options.report_dir / "index.html" if options.report_dir else None
    print_verdict(out, options.command, results, report, inconclusive_fails)
    return document


def write_reports(options: GateOptions, document: dict[str, Any], results: dict[str, Any]) -> None:
    """results.json / junit.xml where asked, and with ``report_dir`` also index.html."""
    from harness.report.junit import write_junit

    report = options.report_dir
    if options.json_path is not None:
        emit_json(options.json_path, document)
    if report:
        write_results(report / "results.json", document)
    for path in (options.junit_path, report / "junit.xml" if report else None):
        if path:
            write_junit(path, results, f"parity {options.command}", options.perf.inconclusive == "fail")
    if report:
        from harness.report.html import write_index

        write_index(report / "index.html", document)
