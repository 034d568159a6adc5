"""What every gate stage shares: the options of a gate run, the context a stage runs in, the stage protocol,
and the per-case loop of the stages that run a pipeline.

A stage has a ``name``, ``skip_reason(ctx) -> str | None`` (e.g. its cases directory is absent),
``preflight(ctx)`` (load and validate its inputs: called for every stage before any stage runs,
so a configuration error in a later stage exits 2 at once) and ``run(ctx) -> StageResult``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from rich.console import Console

from harness.cases.image import ImageCase
from harness.contracts.runner import RunOptions
from harness.perf.sampling import Sampling
from harness.perf.sides import versus
from harness.pipelines.sessions import PipelineRun
from harness.project import Project
from harness.ranks import PoolSet, RankFailure, capacity_reason
from harness.report.console import Tables, progress
from harness.results import FAILED, SKIPPED, CaseResult, StageResult, Status
from harness.targets.base import PipelineFailed
from harness.targets.spec import TargetSpec

PERF_PROFILES = ("pr_test", "long_term")
INCONCLUSIVE_POLICIES = ("fail", "pass")


@dataclass(frozen=True, kw_only=True)
class PerfOptions:
    """The perf stage. ``base`` set: an A/B of every image case, BASE against the case's own pipeline (HEAD),
    sampled by ``sampling``; else absolute: ``runs`` timed runs per case against this machine's stored
    baseline (``profile``: its tolerances, default pr_test).

    ``enabled`` None: on in an A/B, else only where this machine has a perf baseline. ``inconclusive``:
    ``fail`` (an undecided A/B is not a pass: exit 3 when nothing failed) or ``pass``. ``cases``:
    globs of the image cases to time (all when empty). ``ratio_contracts``: also the perf contract
    cases of ``<cases>/perf`` (the gate runs them; ``parity perf`` times pipelines only).
    """

    enabled: bool | None = None
    runs: int = 5
    profile: str | None = None
    base: TargetSpec | None = None
    sampling: Sampling = field(default_factory=Sampling)
    inconclusive: str = "fail"
    cases: tuple[str, ...] = ()
    ratio_contracts: bool = True


@dataclass(frozen=True, kw_only=True)
class GateOptions:
    """Everything a gate run needs; built by ``parity gate`` (or any caller), never an argparse namespace."""

    cases_root: Path
    baselines_dir: Path
    run: RunOptions = field(default_factory=RunOptions)
    pipeline: TargetSpec = TargetSpec()  # the pipeline target of the image and perf stages' cases that name none
    report_dir: Path | None = None
    json_path: Path | str | None = None  # "-": stdout (the tables then go to stderr)
    junit_path: Path | None = None
    clip_model: str | None = None
    perf: PerfOptions = field(default_factory=PerfOptions)
    keep_outputs: bool = False  # save the candidates of passing image cases too (failing ones always are)
    stages: tuple[
        str, ...
    ] = ()  # the stages to run (every stage when empty): ``parity perf`` runs the perf stage alone
    command: str = "gate"  # the verb the results document and the last line name
    project: Project | None = None  # the project file in effect: recorded, and what printed commands need not repeat
    tables: Tables = "all"  # the result tables' rows: all, failures (--failures-only) or none (-q)

    def recorded_target(self) -> TargetSpec:
        """The target a results document names: the attention target, but for a run of the A/B alone (``parity
        perf``), which runs no contract, its two sides (their arguments are in the perf section)."""
        if self.stages == ("perf",) and self.perf.base is not None:
            return TargetSpec(versus(self.perf.base, self.pipeline))
        return self.run.target

    def carried(self, *, target: bool = False, baselines: bool = True) -> list[str]:
        """The options a printed command must repeat to run on these cases, baselines, pipeline (and target) and device."""
        from harness.project import carried_options

        return carried_options(
            self.project,
            cases=self.cases_root,
            baselines=self.baselines_dir if baselines else None,
            target=self.run.target if target else None,
            pipeline=None if target else self.pipeline,
            device=self.run.device,
        )


@dataclass
class GateContext:
    options: GateOptions
    out: Console
    err: Console
    pools: PoolSet  # one rank group per world size for the whole gate: stages share them

    @property
    def device(self) -> str:
        return self.options.run.device


Plan = TypeVar("Plan")  # what a stage reads in its preflight and runs


class Stage(Protocol[Plan]):
    """A gate stage: whether it runs, its plan (read and checked before any stage runs, so a bad file exits 2
    at once), and its run of that plan."""

    name: str

    def skip_reason(self, ctx: GateContext) -> str | None: ...

    def preflight(self, ctx: GateContext) -> Plan: ...

    def run(self, ctx: GateContext, plan: Plan) -> StageResult: ...


def own_pipeline(case: ImageCase) -> list[tuple[PipelineRun, str]]:
    """What most stages run for a case: its own pipeline target, in the untagged pools."""
    return [(case.pipeline_run, "")]


def run_each_case(
    ctx: GateContext,
    label: str,
    cases: Sequence[ImageCase],
    check: str,
    judge: Callable[[ImageCase], CaseResult],
    runs_of: Callable[[ImageCase], Sequence[tuple[PipelineRun, str]]] = own_pipeline,
) -> tuple[list[CaseResult], float]:
    """``judge(case)`` for every case in the gate's pools, with a progress bar; the results and the wall time.

    ``runs_of`` says which pipelines a case runs, each with the tag of its pools (an A/B runs two).
    A case's duration excludes starting its groups. A case that a target cannot run on this
    machine is skipped with the target's reason, one that needs more ranks than the job has with
    that. A rank that fails (raises, dies, hangs), or a pipeline that fails in a way its target
    explains (:class:`PipelineFailed`), fails that case with the traceback or stderr; the stage goes
    on with the next case.
    """
    start = time.perf_counter()
    results: list[CaseResult] = []
    plans = {c.id: runs_of(c) for c in cases}
    skips = {c.id: next((r for run, _ in plans[c.id] if (r := _why_not(run, ctx.device))), None) for c in cases}
    with progress(ctx.err, len(cases), label) as advance:
        _prestart(ctx, {case_id: plan for case_id, plan in plans.items() if not skips[case_id]})
        for case in cases:
            result = _judged(ctx, case, check, judge, plans[case.id], skips[case.id])
            results.append(result)
            advance(result)
    return results, time.perf_counter() - start


def _prestart(ctx: GateContext, plans: Mapping[str, Sequence[tuple[PipelineRun, str]]]) -> None:
    """Start, in the background, every rank group the runnable cases' plans need, per pool tag."""
    for tag in sorted({tag for plan in plans.values() for _, tag in plan}):
        ctx.pools.prestart(
            (run.world_size for plan in plans.values() for run, t in plan if t == tag and run.in_ranks), tag
        )


def _judged(
    ctx: GateContext,
    case: ImageCase,
    check: str,
    judge: Callable[[ImageCase], CaseResult],
    plan: Sequence[tuple[PipelineRun, str]],
    skip: str | None,
) -> CaseResult:
    """One case's result with its duration (starting its groups excluded); a failing rank or pipeline fails it."""
    t0 = time.perf_counter()
    try:
        if skip:
            result = _failed_or_skipped(case, check, SKIPPED, skip)
        else:
            for run, tag in plan:
                if run.in_ranks:
                    ctx.pools.get(run.world_size, tag)
            t0 = time.perf_counter()
            result = judge(case)
    except (RankFailure, PipelineFailed) as exc:
        detail = exc.traceback if isinstance(exc, RankFailure) else exc.detail
        result = _failed_or_skipped(case, check, FAILED, str(exc).splitlines()[0], detail)
    result.duration_s = time.perf_counter() - t0
    return result


def _why_not(run: PipelineRun, device: str) -> str | None:
    """Why a case's pipeline run cannot run here: its target's reason, or more ranks than the job has."""
    return run.unavailable(device) or (capacity_reason(run.world_size) if run.in_ranks else None)


def _failed_or_skipped(
    case: ImageCase, check: str, status: Status, reason: str, traceback: str | None = None
) -> CaseResult:
    return CaseResult(
        case.id,
        f"{check}.{case.kind}",
        status,
        reason,
        params=case_params(case),
        target=case.target.name,
        traceback=traceback,
    )


def case_params(case: ImageCase) -> dict[str, object]:
    """An image case as a result's ``params``: its degrees, kind, pipeline fields and target arguments (when any)."""
    args = {"target_args": dict(case.target.args)} if case.target.args else {}
    return {
        "world_size": case.world_size,
        "ulysses_degree": case.ulysses_degree,
        "ring_degree": case.ring_degree,
        "kind": case.kind,
        **case.fields,
        **args,
    }
