"""The gate's perf stage: time every image case and check it against this machine's perf baseline.

Per case (:func:`harness.gate.pipeline_runs.time_case`): warm-up runs, then ``--perf-runs`` timed
ones, the median of each value; the check is sglang's, ``actual <= expected * (1 + tol)`` per
value (e2e, each stage, each step, average/median step) with the tolerances of
the chosen profile (env ``PARITY_PERF_TOL_*`` overrides them; see :mod:`harness.baselines.perf`).
The baseline is :meth:`PerfBaselines.for_platform` of this hardware: the perf overlay
``<baselines>/platforms/perf/<platform>.json`` (or base scenarios that name this platform).

On by default only where such a baseline exists: timings are a property of one machine, and
gating a CPU runner against numbers from another machine (or from itself on a noisy day) would
fail CI on noise. Where none exists the gate says so and how to make one. ``--perf`` forces
the stage: every case is measured and, without a baseline, reported skipped with that reason;
its results.json then carries the measurements (top-level ``perf``) that
``parity recalibrate perf`` turns into a new overlay. ``--no-perf`` turns it off.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.baselines.perf import CALIBRATION, NORMALISED_PROFILE, PERF_BASE_FILE, PerfBaselines, PerfCheck, check_perf
from harness.baselines.platforms import hardware_name, platform_name
from harness.cases.contract import load_cases, platform_of_device
from harness.cases.image import ImageCase, image_case_dir, load_image_cases
from harness.contracts.case import Case
from harness.gate.contracts import run_contract_cases
from harness.gate.calibration import machine_factor
from harness.files.reading import is_directory_present, is_present
from harness.gate.pipeline_runs import time_case
from harness.gate.stage import GateContext, case_params, run_each_case
from harness.report.console import Column, figure_column, result_table
from harness.results import FAILED, PASSED, SKIPPED, CaseResult, StageResult, summary_line

DEFAULT_CASE_TIMEOUT_S = 600.0
RATIO_CASES_DIR = "perf"
ABSOLUTE_PROFILE = "pr_test"
PERF_COLUMNS: tuple[Column, ...] = (
    figure_column("e2e ms", "e2e_ms"), figure_column("expected", "expected_e2e_ms"), figure_column("× machine", "machine_factor"),
    figure_column("denoise ms", "denoise_ms"),
    figure_column("step ms", "median_step_ms"), figure_column("peak MB", "peak_memory_mb"),
)


def how_to_create(platform: str) -> str:
    """The commands that give a machine its perf baseline."""
    return (f"to create one, run `parity gate --perf --report DIR` 3 times on this machine, then "
            f"`parity recalibrate perf --results DIR*/results.json --write` (writes platforms/perf/{platform}.json)")


def machine_baseline(ctx: GateContext, platform: str) -> PerfBaselines | None:
    """This machine's perf baselines, or None when the base file is absent (anything else there is an error)."""
    if not is_present(ctx.options.baselines_dir / PERF_BASE_FILE):
        return None
    return PerfBaselines.for_platform(ctx.options.baselines_dir, platform)


def failed_checks(checks: list[PerfCheck]) -> list[str]:
    """One line per value over its limit: ``stages_ms.DenoisingStage 35.2 > 30 (25 ms +20%)``, or
    ``(0.5 ms + 1 ms floor)`` where the absolute floor set the limit."""
    lines = []
    for c in checks:
        if c.passed:
            continue
        actual = "not measured" if c.actual is None else f"{c.actual:.4g}"
        relative = c.expected * (1.0 + c.tol)
        slack = f"+{c.tol:.0%}" if c.limit <= relative * (1 + 1e-9) else f"+ {c.limit - c.expected:.3g} ms floor"
        lines.append(f"{c.metric} {actual} > {c.limit:.4g} ({c.expected:.4g} ms {slack})")
    return lines


class PerfStage:
    """Timings of every image case under ``<cases>/images`` against this machine's perf baseline, and the
    perf contracts of ``<cases>/perf`` (ratios timed side by side: they need no baseline)."""

    name = "perf"

    def skip_reason(self, ctx: GateContext) -> str | None:
        choice = ctx.options.perf.enabled
        if choice is False:
            return "--no-perf"
        directory = image_case_dir(ctx.options.cases_root)
        if not is_directory_present(directory):
            return f"no image cases to time ({directory} does not exist)"
        if choice:
            return None
        platform = platform_name(ctx.device)
        baseline = machine_baseline(ctx, platform)
        if baseline is None:
            return f"no {PERF_BASE_FILE} in {ctx.options.baselines_dir}"
        if not baseline.scenario_ids:
            return f"no perf baseline for hardware '{platform}'; {how_to_create(platform)}"
        return None

    def preflight(self, ctx: GateContext) -> None:
        """The baseline files, the env tolerances and the perf contract cases are read before any stage
        runs: a bad one exits 2 at once."""
        baseline = machine_baseline(ctx, platform_name(ctx.device))
        if baseline is not None:
            for profile in {ctx.options.perf.profile or ABSOLUTE_PROFILE, ctx.options.perf.profile or NORMALISED_PROFILE}:
                baseline.tolerances(profile)
        self._ratio_cases = _ratio_cases(ctx)

    _ratio_cases: list[Case] | None = None

    def run(self, ctx: GateContext) -> StageResult:
        options, perf = ctx.options, ctx.options.perf
        platform = platform_name(ctx.device)
        baseline = machine_baseline(ctx, platform)
        cases = sorted(load_image_cases(options.cases_root, options.pipeline, options.pipeline_args), key=lambda c: c.world_size)
        timeout = options.run.timeout or DEFAULT_CASE_TIMEOUT_S
        measured_all: dict[str, dict[str, Any]] = {}

        def judge(case: ImageCase) -> CaseResult:
            measured = time_case(case, ctx.pools, runs=perf.runs, warmup=perf.warmup, timeout=timeout).measured()
            measured_all[case.id] = measured
            expected = baseline.scenario(case.id) if baseline is not None else None
            result = CaseResult(case.id, f"perf.{case.kind}", SKIPPED, params=case_params(case), target=case.target,
                                figures=_figures(measured))
            if baseline is None or expected is None:
                result.reason = f"no perf baseline for scenario '{case.id}' on '{platform}'"
                return result
            return _judge(result, measured, expected, baseline, perf.profile)

        results, wall = run_each_case(ctx, self.name, cases, "perf", judge)
        ratio_cases, self._ratio_cases = self._ratio_cases if self._ratio_cases is not None else _ratio_cases(ctx), None
        if ratio_cases:
            ratios = run_contract_cases(ratio_cases, options.run, ctx.pools, ctx.err, "perf ratios")
            results += ratios.results
            wall += ratios.wall_s
        ctx.out.print(result_table(results, f"gate: perf ({platform}, median of {perf.runs} after {perf.warmup} warm-up)",
                                   PERF_COLUMNS))
        ctx.out.print(f"perf: {summary_line(results, wall)}")
        return StageResult(
            self.name, results, wall,
            extra={
                "platform": platform,
                "baseline_files": baseline.paths if baseline is not None else [],
                "profile": perf.profile or f"{NORMALISED_PROFILE} where calibrated, else {ABSOLUTE_PROFILE}",
                "pool_startup_s": {str(w): s for w, s in sorted(ctx.pools.startup_s.items())},
            },
            top_level={"platform": platform, "device_name": hardware_name(ctx.device), "perf": measured_all},
        )


def _ratio_cases(ctx: GateContext) -> list[Case]:
    """The perf contract cases (``<cases>/perf/*.toml``: ratios timed side by side), with this platform's overlay."""
    directory = ctx.options.cases_root / RATIO_CASES_DIR
    return load_cases(directory, platform_of_device(ctx.device)) if directory.is_dir() else []


def _figures(measured: dict[str, Any]) -> dict[str, Any]:
    return {
        "e2e_ms": measured["expected_e2e_ms"],
        "denoise_ms": measured["stages_ms"].get("DenoisingStage"),
        "median_step_ms": measured.get("expected_median_denoise_ms"),
        "peak_memory_mb": measured["peak_memory_mb"],
        "peak_memory_kind": measured["peak_memory_kind"],
        "clock": measured["clock"],
        "measured": measured,
    }


def _judge(result: CaseResult, measured: dict[str, Any], expected: dict[str, Any], baseline: PerfBaselines,
           profile: str | None) -> CaseResult:
    """The verdict against the baseline scenario: normalised by the machine factor where both sides carry a
    calibration, else absolute; the figures say which gated and why."""
    figures = result.figures
    calibrated = CALIBRATION in expected and CALIBRATION in measured
    if calibrated:
        machine = machine_factor(measured[CALIBRATION], expected[CALIBRATION])
        factor, tolerances = machine.value, baseline.tolerances(profile or NORMALISED_PROFILE)
        figures.update(gated="normalised", machine_factor=factor, factor_from=machine.how, probe_ratios=machine.ratios,
                       calibration_baseline=expected[CALIBRATION])
        how = f"normalised: expected × {factor:.3g} ({machine.how})"
    else:
        factor, tolerances = 1.0, baseline.tolerances(profile or ABSOLUTE_PROFILE)
        missing = "the baseline has no calibration" if CALIBRATION not in expected else "this run has no calibration"
        figures.update(gated="absolute", why_absolute=missing)
        how = f"absolute ({missing}: re-record it with `parity recalibrate perf`)"
    checks = check_perf(expected, measured, tolerances, factor=factor)
    problems = failed_checks(checks)
    figures["expected_e2e_ms"] = expected["expected_e2e_ms"] * factor
    figures["tolerances"] = dataclasses.asdict(tolerances)
    figures["values"] = [dataclasses.asdict(c) for c in checks]
    result.status, result.reason = (FAILED, "; ".join(problems) + f" [{how}]") if problems else (PASSED, None)
    result.bound = f"{len(checks)} values within their tolerance, {how}"
    return result
