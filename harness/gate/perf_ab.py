"""The A/B half of the perf stage: both sides launched for a block, progress while pairs run, a case's result and,
when it is undecided, what would decide it. The sampling and the statistics: :mod:`harness.perf.ab`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from typing import Any

from harness.baselines.perf import E2E
from harness.baselines.tolerances import Tolerances
from harness.cases.image import ImageCase
from harness.gate.stage import GateContext, case_params
from harness.perf.ab import ORDER, Comparison, FigureVerdict, Stop
from harness.perf.figures import WALL, family
from harness.perf.sampling import Sampling
from harness.perf.sides import BASE, HEAD, versus
from harness.perf.stats import BLOCK_METHOD, MAX_PAIRS, METHOD
from harness.pipelines.sessions import PipelineRun, Session
from harness.pipelines.side_by_side import start_side_by_side
from harness.project.hints import carried_options, command
from harness.results import FAILED, INCONCLUSIVE, PASSED, CaseResult
from harness.targets.spec import TargetSpec

PROGRESS_EVERY_S = 5.0  # a line at most this often, so one comes at least every 10 s while pairs take under 5 s
POOL_TAGS = {BASE: "perf-base", HEAD: "perf-head"}


@contextlib.contextmanager
def launched(
    ctx: GateContext, specs: dict[str, PipelineRun], timeout: float, replicas: int, block: int
) -> Iterator[tuple[Session, Session]]:
    """Both sides started afresh for launch block ``block`` (BASE first in even blocks, HEAD first in odd ones): rank
    pools of their own (block 0's are the ones the stage prestarted), a server launched anew by a target instance of
    its own (one per side and block modulo two launches of ``replicas``: the replicas of a launch and of the one
    overlapped beside it never share one); all ended on exit."""
    order = (BASE, HEAD) if block % 2 == 0 else (HEAD, BASE)
    specs = {side: run if run.in_ranks else _instance(run, block % (2 * replicas)) for side, run in specs.items()}
    tags = {side: POOL_TAGS[side] + (f"-{block}" if block else "") for side in order}

    def start(side: str) -> Session:
        return Session(specs[side], ctx.pools, tag=tags[side], timeout=timeout)

    try:
        with contextlib.ExitStack() as stack:
            if any(specs[side].in_ranks for side in order):  # rank pools start one at a time
                sessions = {side: stack.enter_context(start(side)) for side in order}
            else:  # two servers (or commands) start side by side: a launch costs the slower start, not both
                sessions = start_side_by_side(stack, order, start, lambda side: specs[side].pipeline.stop())
            yield sessions[BASE], sessions[HEAD]
    finally:
        for side in order:
            if specs[side].in_ranks:
                ctx.pools.release(specs[side].world_size, tags[side])
            else:
                specs[side].pipeline.stop()


def _instance(run: PipelineRun, slot: int) -> PipelineRun:
    """``run`` on a target instance of its own for blocks in this slot (a rank group needs none: its pool's tag
    already names the block)."""
    return dataclasses.replace(run, instance=f"{run.instance}#{slot}")


class Progress:
    """A line on stderr every :data:`PROGRESS_EVERY_S` of an A/B: pairs, launches, e2e so far."""

    def __init__(self, ctx: GateContext, case_id: str) -> None:
        self.ctx, self.case_id, self.last = ctx, case_id, time.monotonic()

    def __call__(self, pairs: int, launches: int, e2e: FigureVerdict | None) -> None:
        if time.monotonic() - self.last < PROGRESS_EVERY_S:
            return
        self.last = time.monotonic()
        shown = e2e.describe() if e2e is not None else "no verdict yet"
        self.ctx.err.print(
            f"perf {self.case_id}: {pairs} pairs, launch {launches}: {shown}", markup=False, highlight=False
        )


def next_step(
    ctx: GateContext,
    case: ImageCase,
    base: TargetSpec,
    head: TargetSpec,
    comparison: Comparison,
    replicable: bool = False,
) -> str:
    """What would decide an inconclusive case: ``parity perf`` of it with the pairs and time the noise so far says it
    needs, or, where that is beyond parity's most pairs, steadier runs (more servers a launch, for ``replicable``
    sides launched one at a time: docs/perf.md, Replicas) or a wider tolerance."""
    sampling = ctx.options.perf.sampling
    needed = comparison.pairs_to_decide()
    if needed <= MAX_PAIRS and comparison.verdicts:
        pairs = max(needed, sampling.max_pairs)
        seconds = math.ceil(max(sampling.max_time_s, 1.2 * comparison.seconds * needed / max(1, comparison.pairs)))
        argv = ["perf", base.name, head.name, case.id]
        for option, side in (("--base-arg", base), ("--head-arg", head)):
            argv += [f"{option}={k}={v}" for k, v in side.args]
        o = ctx.options
        where = carried_options(o.project, cases=o.cases_root, baselines=o.baselines_dir, device=o.run.device)
        more = [*argv, "--max-pairs", str(pairs), "--max-time", str(seconds), *_launch_options(sampling)]
        return f"to decide it (about {needed} pairs at this noise): {command(more, where)}"
    if not comparison.verdicts:
        return f"no figure was judged within --max-time {sampling.max_time_s:g}: give it more time"
    label = comparison.undecided[0].label
    steadier = "fewer ranks per core, a quieter machine"
    if replicable and comparison.replicas == 1 and comparison.launches > 1:
        steadier += ", or --replicas 3 where six servers fit: each server's slow spells spread over more blocks"
    return (
        f"no more pairs decide it here: {label} moves ±{comparison.pair_noise(label):.0%} a pair on this machine, "
        f"too much for {MAX_PAIRS} pairs (parity's most) to bound within its tolerance; time it where runs are "
        f"steadier ({steadier}) or widen the tolerance (PARITY_PERF_TOL_{family(label).upper()})"
    )


def _launch_options(sampling: Sampling) -> list[str]:
    """How the A/B launched its sides, as `parity perf` options: the command that decides it launches alike."""
    replicas = ["--replicas", str(sampling.replicas)] if sampling.replicas > 1 else []
    return replicas + (["--overlap-launches"] if sampling.overlap else [])


def _launches(comparison: Comparison, per_run: bool) -> str:
    n, replicas = comparison.launches, comparison.replicas
    each = f" of {replicas} replicas" if replicas > 1 else ""
    return "a process per run" if per_run else f"{n} launch{'es' if n > 1 else ''}{each} of each side"


def _headline(comparison: Comparison) -> dict[str, float]:
    """e2e and parity's wall clock as flat figures (``e2e_ratio``, ``wall_ratio_low``, ...), where judged."""
    flat: dict[str, float] = {}
    for key, label in (("e2e", E2E), ("wall", WALL)):
        verdict = comparison.verdict(label)
        if verdict is not None and verdict.interval is not None:
            i = verdict.interval
            flat |= {f"{key}_base_ms": verdict.base_ms, f"{key}_head_ms": verdict.head_ms, f"{key}_ratio": i.ratio}
            flat |= {f"{key}_ratio_low": i.low, f"{key}_ratio_high": i.high}
    return flat


def ab_result(
    case: ImageCase,
    comparison: Comparison,
    base: TargetSpec,
    head: TargetSpec,
    confidence: float,
    tolerances: Tolerances,
    per_run: bool = False,
) -> CaseResult:
    """An A/B as a case result: failed if any figure is slower beyond its limit, inconclusive if any is undecided.
    ``per_run``: both sides start a process per run, so one block spreads process bias over every run."""
    figures = {
        "mode": "ab",
        **_sampled(comparison, per_run, confidence),
        "base": base.describe(),
        "head": head.describe(),
        **_headline(comparison),
        "figures_judged": {v.label: v.to_json() for v in comparison.verdicts},
        "unpaired": comparison.unpaired,
        "peak_memory_mb": comparison.peak_memory_mb,
        "tolerances": dataclasses.asdict(tolerances),
        "samples": comparison.samples,
    }
    result = CaseResult(
        case.id, f"perf.{case.kind}", PASSED, params=case_params(case), target=versus(base, head), figures=figures
    )
    result.bound = (
        f"{len(comparison.verdicts)} figures: HEAD/BASE within 1 + tolerance at {confidence:.0%} "
        f"({comparison.pairs} {ORDER} pairs over {_launches(comparison, per_run)})"
    )
    if comparison.failed:
        result.status = FAILED
        result.reason = "HEAD is slower than BASE: " + "; ".join(v.describe() for v in comparison.failed)
    elif comparison.undecided or not comparison.verdicts:
        result.status = INCONCLUSIVE
        shown = "; ".join(v.describe() for v in comparison.undecided[:3]) or "no figure judged yet"
        more = f"; and {len(comparison.undecided) - 3} more" if len(comparison.undecided) > 3 else ""
        over = _launches(comparison, per_run)
        result.reason = f"undecided after {comparison.pairs} pairs over {over} ({_stopped(comparison)}): {shown}{more}"
    return result


def _sampled(comparison: Comparison, per_run: bool, confidence: float) -> dict[str, Any]:
    """How the A/B sampled: pairs, launches (overlapped, refused), replicas, why it stopped, the method."""
    sampled: dict[str, Any] = {
        "pairs": comparison.pairs,
        "launches": comparison.launches,
        "overlapped_launches": comparison.overlapped,
        "replicas": comparison.replicas,
        "stopped": str(comparison.stop),
        "sampling_s": round(comparison.seconds, 3),
        "process_per_run": per_run,
        "confidence": confidence,
        "method": METHOD if comparison.launches * comparison.replicas == 1 else BLOCK_METHOD,
        "order": ORDER,
    }
    if comparison.overlap_refused is not None:
        sampled["overlap_refused"] = comparison.overlap_refused
    return sampled


def _stopped(comparison: Comparison) -> str:
    """What ended the sampling: ``--max-pairs`` or ``--max-time``, in the words of the options."""
    if comparison.stop == Stop.TIME:
        return f"{comparison.seconds:.0f} s, --max-time"
    return "--max-pairs"
