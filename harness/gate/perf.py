"""The gate's perf stage: every image case timed, BASE against HEAD side by side, or raw against a stored baseline.

**A/B** (``--perf-base SPEC``, ``parity perf BASE HEAD``): the case's own pipeline target is HEAD,
``SPEC`` BASE; both prepared in pools of their own on the same devices and run interleaved until
every figure has a verdict (:mod:`harness.perf.ab`). The verdict that holds on a shared machine.
**Absolute** (otherwise): ``runs`` timed runs per case, their medians against this machine's
``<baselines>/platforms/perf/<platform>.json`` as sglang's dedicated runners do (``actual <=
expected * (1 + tol)``, ``PARITY_PERF_TOL_*`` overriding); on only where such a baseline exists,
``--perf`` measures anyway for ``parity recalibrate perf``. Both modes also run the perf contract
cases of ``<cases>/perf`` unless the caller times pipelines only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from harness.baselines.perf import AB_PROFILE, E2E, PERF_BASE_FILE, PerfBaselines, PerfCheck, check_perf
from harness.baselines.platforms import hardware_name, platform_name
from harness.baselines.tolerances import Tolerances
from harness.cases.contract import load_cases, platform_of_device
from harness.cases.image import ImageCase, check_case_on, image_case_dir, load_image_cases, select_image_cases
from harness.contracts.case import Case
from harness.files.reading import is_directory_present, is_present
from harness.gate.contracts import run_contract_cases
from harness.gate.perf_ab import POOL_TAGS, Progress, ab_result, launched, next_step
from harness.gate.stage import GateContext, case_params, own_pipeline, run_each_case
from harness.perf import absolute
from harness.perf.ab import ORDER, compare
from harness.perf.figures import WALL
from harness.perf.sampling import Sampling
from harness.perf.sides import BASE, HEAD, Revisions
from harness.pipelines.sessions import PipelineRun, Session
from harness.project.hints import command
from harness.report.console import Column, figure_column, print_results
from harness.results import FAILED, INCONCLUSIVE, PASSED, SKIPPED, CaseResult, StageResult, summary_line
from harness.targets.spec import TargetSpec

DEFAULT_CASE_TIMEOUT_S = 600.0
RATIO_CASES_DIR = "perf"
ABSOLUTE_PROFILE = "pr_test"
ABSOLUTE_COLUMNS: tuple[Column, ...] = (
    figure_column("e2e ms", "e2e_ms"),
    figure_column("expected", "expected_e2e_ms"),
    figure_column("wall ms", "wall_ms"),
    figure_column("denoise ms", "denoise_ms"),
    figure_column("step ms", "median_step_ms"),
    figure_column("peak MB", "peak_memory_mb"),
)
AB_COLUMNS: tuple[Column, ...] = (
    figure_column("base e2e ms", "e2e_base_ms"),
    figure_column("head e2e ms", "e2e_head_ms"),
    figure_column("head/base", "e2e_ratio"),
    ("interval", lambda r: _interval(r.figures)),
    figure_column("pairs", "pairs"),
)


def _interval(figures: dict[str, Any]) -> str:
    low, high = figures.get("e2e_ratio_low"), figures.get("e2e_ratio_high")
    return f"[{low:.3f}, {high:.3f}]" if isinstance(low, float) and isinstance(high, float) else "-"


def how_to_create(platform: str, gate: Sequence[str], recalibrate: Sequence[str]) -> str:
    """The commands that give a dedicated runner its absolute perf baseline, to paste as they are; ``gate`` and
    ``recalibrate`` are the options each must carry (:func:`harness.project.carried_options`)."""
    runs = [f"perf-run{i}" for i in (1, 2, 3)]
    lines = [command(["gate", "--perf", "--report", run], gate) for run in runs]
    lines.append(
        command(["recalibrate", "perf", "--results", *(f"{run}/results.json" for run in runs), "--write"], recalibrate)
    )
    return f"to create one on this machine, run `{' && '.join(lines)}` (writes platforms/perf/{platform}.json)"


def machine_baseline(ctx: GateContext, platform: str) -> PerfBaselines | None:
    """This machine's perf baselines, or None when the base file is absent (anything else there is an error)."""
    if not is_present(ctx.options.baselines_dir / PERF_BASE_FILE):
        return None
    return PerfBaselines.for_platform(ctx.options.baselines_dir, platform)


def ab_tolerances(ctx: GateContext) -> Tolerances:
    """The A/B profile of the baselines' perf file where it has one, else the built-in one (env overrides either)."""
    baseline = machine_baseline(ctx, platform_name(ctx.device))
    return (baseline or PerfBaselines.from_json({}, "built-in")).tolerances(AB_PROFILE)


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


def _baselines_only(ctx: GateContext) -> list[str]:
    """What ``parity recalibrate perf`` must carry to write into this run's baselines."""
    from harness.project import carried_options

    return carried_options(ctx.options.project, baselines=ctx.options.baselines_dir)


@dataclasses.dataclass(frozen=True)
class PerfPlan:
    """What the perf stage times: the image cases (an A/B or against the stored baselines) and its ratio cases."""

    cases: list[ImageCase]
    ratio_cases: list[Case]


class PerfStage:
    """The timings of the image cases (A/B or absolute, see the module docstring) and the perf contract cases."""

    name = "perf"

    def skip_reason(self, ctx: GateContext) -> str | None:
        perf = ctx.options.perf
        if perf.enabled is False:
            return "--no-perf"
        directory = image_case_dir(ctx.options.cases_root)
        if not is_directory_present(directory):
            return f"no image cases to time ({directory} does not exist)"
        if perf.enabled or perf.base is not None:
            return None
        platform = platform_name(ctx.device)
        baseline = machine_baseline(ctx, platform)
        if baseline is None or not baseline.scenario_ids:
            where = (
                f"no {PERF_BASE_FILE} in {ctx.options.baselines_dir}"
                if baseline is None
                else f"no perf baseline for hardware '{platform}'"
            )
            return (
                f"{where}; time HEAD against BASE side by side with `--perf-base SPEC` (or `parity perf BASE HEAD`), "
                f"or, on a dedicated runner, {how_to_create(platform, ctx.options.carried(), _baselines_only(ctx))}"
            )
        return None

    def preflight(self, ctx: GateContext) -> PerfPlan:
        """Cases, tolerances and the BASE side are read before any stage runs: a bad one exits 2 at once."""
        perf = ctx.options.perf
        cases = _image_cases(ctx)
        if perf.base is not None:
            ab_tolerances(ctx)
            for case in cases:
                check_case_on(case, perf.base, "--perf-base")
        else:
            baseline = machine_baseline(ctx, platform_name(ctx.device))
            if baseline is not None:
                baseline.tolerances(perf.profile or ABSOLUTE_PROFILE)
        return PerfPlan(cases, _ratio_cases(ctx))

    def run(self, ctx: GateContext, plan: PerfPlan) -> StageResult:
        options = ctx.options
        platform = platform_name(ctx.device)
        cases, ratio_cases = plan.cases, plan.ratio_cases
        if options.perf.base is not None:
            stage = self._run_ab(ctx, cases)
            title = f"perf: HEAD against BASE {options.perf.base.name} ({platform}, {ORDER} pairs)"
            columns = AB_COLUMNS
        else:
            stage = self._run_absolute(ctx, cases, platform)
            title = f"perf: against the stored baseline ({platform}, median of {options.perf.runs} raw runs)"
            columns = ABSOLUTE_COLUMNS
        if ratio_cases:
            ratios = run_contract_cases(ratio_cases, options.run, ctx.pools, ctx.err, "perf ratios")
            stage.results += ratios.results
            stage.wall_s += ratios.wall_s
        print_results(ctx.out, stage.results, title, columns, ctx.options.tables)
        ctx.out.print(f"perf: {summary_line(stage.results, stage.wall_s)}")
        stage.extra.update(platform=platform, pool_startup_s=dict(sorted(ctx.pools.startup_s.items())))
        stage.top_level = {"platform": platform, "device_name": hardware_name(ctx.device), **stage.top_level}
        return stage

    def _run_ab(self, ctx: GateContext, cases: list[ImageCase]) -> StageResult:
        """Every image case timed HEAD against BASE (:mod:`harness.perf.ab`)."""
        perf, timeout = ctx.options.perf, ctx.options.run.timeout or DEFAULT_CASE_TIMEOUT_S
        assert perf.base is not None
        tolerances = ab_tolerances(ctx)
        with Revisions() as revisions:
            base = revisions.resolve(perf.base)
            heads = {c.id: revisions.resolve(c.target) for c in cases}

            def runs_of(case: ImageCase) -> list[tuple[PipelineRun, str]]:
                return [
                    (base_run(base, case, BASE), POOL_TAGS[BASE]),
                    (base_run(heads[case.id], case, HEAD), POOL_TAGS[HEAD]),
                ]

            def judge(case: ImageCase) -> CaseResult:
                (base_spec, _), (head_spec, _) = runs_of(case)
                per_run = base_spec.pipeline.process_per_run and head_spec.pipeline.process_per_run
                sampling = _case_sampling(perf.sampling, per_run, base_spec.in_ranks or head_spec.in_ranks)
                specs = {BASE: base_spec, HEAD: head_spec}
                launcher = functools.partial(launched, ctx, specs, timeout, sampling.replicas)
                progress = Progress(ctx, case.id)
                comparison = compare(launcher, sampling, tolerances, progress)
                if comparison.overlap_refused is not None:
                    ctx.err.print(f"perf {case.id}: {comparison.overlap_refused}", markup=False, highlight=False)
                result = ab_result(case, comparison, base, heads[case.id], sampling.confidence, tolerances, per_run)
                if result.status == INCONCLUSIVE:  # the sides as given: a rev: side resolves again when run
                    replicable = not (per_run or base_spec.in_ranks or head_spec.in_ranks)
                    hint = next_step(ctx, case, perf.base, case.target, comparison, replicable)
                    result.reason = f"{result.reason}; {hint}"
                return result

            results, wall = run_each_case(ctx, self.name, cases, "perf", judge, runs_of)
        extra = {
            "mode": "ab",
            "base": base.describe(),
            "heads": {case_id: head.describe() for case_id, head in heads.items()},
            "order": ORDER,
            "sampling": dataclasses.asdict(perf.sampling),
            "tolerances": dataclasses.asdict(tolerances),
            "inconclusive": perf.inconclusive,
        }
        return StageResult(self.name, results, wall, extra=extra)

    def _run_absolute(self, ctx: GateContext, cases: list[ImageCase], platform: str) -> StageResult:
        """Every image case's raw times against the machine's stored perf baseline (:mod:`harness.perf.absolute`)."""
        perf, timeout = ctx.options.perf, ctx.options.run.timeout or DEFAULT_CASE_TIMEOUT_S
        baseline = machine_baseline(ctx, platform)
        measured_all: dict[str, dict[str, Any]] = {}

        def judge(case: ImageCase) -> CaseResult:
            with Session(case.pipeline_run, ctx.pools, timeout=timeout) as session:
                measured = {
                    **absolute.measure(session, runs=perf.runs, warmup=perf.sampling.warmup),
                    "world_size": case.world_size,
                }
            measured_all[case.id] = measured
            expected = baseline.scenario(case.id) if baseline is not None else None
            result = CaseResult(
                case.id,
                f"perf.{case.kind}",
                SKIPPED,
                params=case_params(case),
                target=case.target.name,
                figures=_absolute_figures(measured),
            )
            if baseline is None or expected is None:
                result.reason = f"no perf baseline for scenario '{case.id}' on '{platform}'"
                return result
            return _judge_absolute(result, measured, expected, baseline.tolerances(perf.profile or ABSOLUTE_PROFILE))

        results, wall = run_each_case(ctx, self.name, cases, "perf", judge, own_pipeline)
        extra = {
            "mode": "absolute",
            "baseline_files": baseline.paths if baseline is not None else [],
            "profile": perf.profile or ABSOLUTE_PROFILE,
        }
        return StageResult(self.name, results, wall, extra=extra, top_level={"perf": measured_all})


def _case_sampling(sampling: Sampling, per_run: bool, in_ranks: bool) -> Sampling:
    """A case's sampling: one launch of one replica where both sides start a process per run (each run is a launch);
    launches one after the other, one replica each, where a side runs in rank groups (a pool started beside a timed
    one shares its cores)."""
    if per_run:
        sampling = dataclasses.replace(sampling, launches=1, replicas=1)
    return dataclasses.replace(sampling, overlap=False, replicas=1) if in_ranks else sampling


def base_run(side: TargetSpec, case: ImageCase, instance: str = "") -> PipelineRun:
    """The case's fields on ``side``'s pipeline target (``instance``: which A/B side, for a target run here)."""
    return PipelineRun(side, case.fields, case.world_size, instance)


def _image_cases(ctx: GateContext) -> list[ImageCase]:
    """The image cases to time (``PerfOptions.cases`` of them, when given), fewest ranks first."""
    options = ctx.options
    cases = load_image_cases(options.cases_root, options.pipeline)
    chosen = select_image_cases(cases, options.perf.cases) if options.perf.cases else cases
    return sorted(chosen, key=lambda c: c.world_size)


def _ratio_cases(ctx: GateContext) -> list[Case]:
    """The perf contract cases (``<cases>/perf/*.toml``: ratios timed side by side), with this platform's overlay,
    unless the run times pipelines only."""
    directory = ctx.options.cases_root / RATIO_CASES_DIR
    if not ctx.options.perf.ratio_contracts or not directory.is_dir():
        return []
    return load_cases(directory, platform_of_device(ctx.device))


def _absolute_figures(measured: dict[str, Any]) -> dict[str, Any]:
    return {
        "e2e_ms": measured[E2E],
        "wall_ms": measured[WALL],
        "denoise_ms": measured.get("stages_ms", {}).get("DenoisingStage"),  # none where only the wall clock was timed
        "median_step_ms": measured.get("expected_median_denoise_ms"),
        "peak_memory_mb": measured["peak_memory_mb"],
        "peak_memory_kind": measured["peak_memory_kind"],
        "clock": measured["clock"],
        "measured": measured,
    }


def _judge_absolute(
    result: CaseResult, measured: dict[str, Any], expected: dict[str, Any], tolerances: Tolerances
) -> CaseResult:
    """The raw measurement against the stored scenario, value by value."""
    checks = check_perf(expected, measured, tolerances)
    problems = failed_checks(checks)
    result.figures.update(
        expected_e2e_ms=expected[E2E],
        tolerances=dataclasses.asdict(tolerances),
        values=[dataclasses.asdict(c) for c in checks],
    )
    result.status, result.reason = (
        (FAILED, "; ".join(problems) + " [raw times against the stored baseline]") if problems else (PASSED, None)
    )
    result.bound = f"{len(checks)} raw values within their tolerance of the stored baseline"
    return result
