"""BASE and HEAD side by side: interleaved runs on the same devices, a ratio with an interval per figure, a verdict.

Each launch starts both sides afresh (overlapped: while the launch before runs, :mod:`harness.perf.launches`; how
many pairs and launches: :mod:`harness.perf.sampling`), warms them up (HEAD, then BASE), then runs ABBA pairs
(rotating a pair at a time over the launch's replicas), both runs of a pair on the same cores: drift and a slow core
cancel in a ratio, and in every quartet each side runs once after itself and once after the other (a carry-over
cancels). Once enough pairs and launches are in, every figure is judged (:func:`judge_figure`): passed when its
interval ends within ``1 + tolerance`` (widened by ``abs_floor_ms``), failed when its Bonferroni-corrected interval
starts beyond it. Sampling stops when every figure is decided or one failed, else when ``max_pairs`` or
``max_time_s`` runs out: inconclusive. The method and its measured error rates: docs/perf.md.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from harness.baselines.perf import E2E
from harness.baselines.tolerances import Tolerances
from harness.perf.figures import family, run_figures
from harness.perf.launches import Launch, Launcher, Launches
from harness.perf.sampling import Sampling
from harness.perf.stats import EXACT_PAIRS, MAX_PAIRS, RatioInterval, blocked_ratio
from harness.pipelines.sessions import TimedRun

ORDER = "ABBA"  # pair i runs BASE first when i is even, HEAD first when it is odd


class FigureStatus(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    UNDECIDED = "undecided"


class Stop(StrEnum):
    """Why sampling ended."""

    DECIDED = "decided"
    PAIRS = "pairs"  # --max-pairs reached (or no room left under it for another block)
    TIME = "time"  # the next block or pair would end past --max-time


@dataclass(frozen=True)
class FigureVerdict:
    """One figure of an A/B: both sides' medians, HEAD/BASE with its interval, the limit, the status."""

    label: str
    base_ms: float
    head_ms: float
    limit: float
    interval: RatioInterval | None  # at the confidence asked
    claim: RatioInterval | None  # at the corrected confidence a failure needs
    status: FigureStatus

    def describe(self) -> str:
        """``stages_ms.DenoisingStage ×1.102 [1.081, 1.124], limit 1.050`` (a failure: its claim's interval)."""
        shown = self.claim if self.status == FigureStatus.FAILED else self.interval
        if shown is None:
            return f"{self.label}: too few pairs for an interval"
        text = f"{self.label} ×{shown.ratio:.3f} [{shown.low:.3f}, {shown.high:.3f}], limit {self.limit:.3f}"
        if self.status == FigureStatus.UNDECIDED and shown.low > self.limit and self.claim is not None:
            text += f" (not beyond it at the {self.claim.coverage:.1%} a claim over every figure needs: {self.claim.low:.3f})"
        return text

    def to_json(self) -> dict[str, Any]:
        i, c = self.interval, self.claim
        return {
            "base_median_ms": self.base_ms,
            "head_median_ms": self.head_ms,
            "ratio": i.ratio if i else None,
            "ratio_low": i.low if i else None,
            "ratio_high": i.high if i else None,
            "limit": self.limit,
            "coverage": i.coverage if i else None,
            "claim_low": c.low if c else None,
            "claim_coverage": c.coverage if c else None,
            "status": str(self.status),
        }


def judge_figure(
    label: str,
    base: Sequence[Sequence[float]],
    head: Sequence[Sequence[float]],
    tolerances: Tolerances,
    confidence: float,
    figures: int = 1,
) -> FigureVerdict:
    """The verdict on one figure of ``figures`` judged together, from its paired values per launch block (rules in
    the module docstring; the interval: :func:`harness.perf.stats.blocked_ratio`)."""
    base_ms, head_ms = statistics.median(v for b in base for v in b), statistics.median(v for h in head for v in h)
    limit = 1.0 + max(tolerances.get(family(label)), tolerances.abs_floor_ms / base_ms)
    interval = blocked_ratio(base, head, confidence)
    claim = blocked_ratio(base, head, 1.0 - (1.0 - confidence) / figures)
    if claim is not None and claim.low > limit:
        status = FigureStatus.FAILED
    elif interval is not None and interval.high <= limit:
        status = FigureStatus.PASSED
    else:
        status = FigureStatus.UNDECIDED
    return FigureVerdict(label, base_ms, head_ms, limit, interval, claim, status)


@dataclass
class Comparison:
    """What an A/B found: every paired figure's verdict, what could not be paired and why, the raw samples."""

    pairs: int
    verdicts: list[FigureVerdict]
    unpaired: dict[str, str]
    samples: dict[str, dict[str, list[float]]]  # label -> {"base": [...], "head": [...]}, in pair order
    peak_memory_mb: dict[str, float | None] = field(default_factory=dict)
    stop: Stop = Stop.DECIDED  # why sampling ended
    launches: int = 1  # launch blocks: each side started afresh this many times
    seconds: float = 0.0  # how long sampling took, launches included
    overlapped: int = 0  # launches whose sides started while the launch before ran its pairs
    overlap_refused: str | None = None  # why overlapping launches was given up, if it was
    replicas: int = 1  # instances of each side alive per launch, each pair of them a launch block

    @property
    def capped(self) -> bool:
        """Sampling ran out of pairs or time before every figure was decided."""
        return self.stop != Stop.DECIDED

    @property
    def failed(self) -> list[FigureVerdict]:
        return [v for v in self.verdicts if v.status == FigureStatus.FAILED]

    @property
    def undecided(self) -> list[FigureVerdict]:
        return [v for v in self.verdicts if v.status == FigureStatus.UNDECIDED]

    def verdict(self, label: str) -> FigureVerdict | None:
        return next((v for v in self.verdicts if v.label == label), None)

    def pairs_to_decide(self) -> int:
        """About how many pairs would decide every undecided figure at the noise seen so far (an interval narrows as
        one over the square root of the pairs); MAX_PAIRS + 1 when that is beyond parity's most."""
        needed = 1.2 * max((_pairs_to_decide(v, self.pairs) for v in self.undecided), default=self.pairs)
        return MAX_PAIRS + 1 if needed > MAX_PAIRS else math.ceil(needed)

    def pair_noise(self, label: str) -> float:
        """How much a pair's HEAD/BASE ratio of ``label`` moves: the standard deviation of its log (0.2: ±20 %)."""
        sides = self.samples[label]
        logs = [math.log(h / b) for b, h in zip(sides["base"], sides["head"]) if b > 0 and h > 0]
        return statistics.stdev(logs) if len(logs) > 1 else 0.0


def _pairs_to_decide(verdict: FigureVerdict, pairs: int) -> float:
    """Pairs at which ``verdict``'s interval (below the limit) or its claim's (above it) would no longer reach the
    limit, were the estimate to stay where it is."""
    interval, claim = verdict.interval, verdict.claim
    if interval is None or (claim is None and interval.ratio >= verdict.limit):
        return 2.0 * pairs  # too few pairs for an interval yet
    estimate, limit = math.log(interval.ratio), math.log(verdict.limit)
    if estimate < limit:
        half = math.log(interval.high) - estimate
    else:
        assert claim is not None
        half = estimate - math.log(claim.low)
    distance = abs(limit - estimate)
    return math.inf if distance == 0 else pairs * (half / distance) ** 2


def _peak_mb(runs: Sequence[TimedRun]) -> float | None:
    peaks = [p for r in runs for p in r.peak_memory_bytes]
    return round(max(peaks) / 2**20, 1) if peaks else None


def _paired(base: list[dict[str, float]], head: list[dict[str, float]]) -> tuple[list[str], dict[str, str]]:
    """The labels every run of both sides recorded with a positive time, and why each other label is left out."""
    seen = {label for run in base + head for label in run}
    paired, unpaired = [], {}
    for label in sorted(seen):
        if not all(label in r for r in base):
            unpaired[label] = (
                "recorded by HEAD only" if not any(label in r for r in base) else "missing from some BASE runs"
            )
        elif not all(label in r for r in head):
            unpaired[label] = (
                "recorded by BASE only" if not any(label in r for r in head) else "missing from some HEAD runs"
            )
        elif any(r[label] <= 0 for r in base + head):
            unpaired[label] = "a run recorded 0 ms: no ratio"
        else:
            paired.append(label)
    return paired, unpaired


@dataclass
class _Runs:
    """Every timed run so far, per side, with the launch block each came from."""

    base: list[TimedRun] = field(default_factory=list)
    head: list[TimedRun] = field(default_factory=list)
    block: list[int] = field(default_factory=list)

    def judge(self, tolerances: Tolerances, confidence: float) -> tuple[list[FigureVerdict], dict[str, str]]:
        base, head = [run_figures(r) for r in self.base], [run_figures(r) for r in self.head]
        labels, unpaired = _paired(base, head)
        blocks = sorted(set(self.block))
        verdicts = [
            judge_figure(
                label,
                [[r[label] for r, b in zip(base, self.block) if b == k] for k in blocks],
                [[r[label] for r, b in zip(head, self.block) if b == k] for k in blocks],
                tolerances,
                confidence,
                len(labels),
            )
            for label in labels
        ]
        return verdicts, unpaired

    def samples(self, labels: Sequence[str]) -> dict[str, dict[str, list[float]]]:
        base, head = [run_figures(r) for r in self.base], [run_figures(r) for r in self.head]
        return {
            label: {"base": [r[label] for r in base], "head": [r[label] for r in head], "launch": list(self.block)}
            for label in labels
        }


def _decided(verdicts: Sequence[FigureVerdict]) -> bool:
    statuses = {v.status for v in verdicts}
    return FigureStatus.FAILED in statuses or FigureStatus.UNDECIDED not in statuses


def compare(
    launch: Launcher,
    sampling: Sampling,
    tolerances: Tolerances,
    on_pair: Callable[[int, int, FigureVerdict | None], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Comparison:
    """Run both sides interleaved, launch by launch, until the verdict is decided or sampling runs out of
    pairs or time (module docstring); ``on_pair(pairs, launches, e2e verdict so far)`` after every pair."""
    state = _Sampler(sampling, tolerances, on_pair or (lambda *_: None), clock)
    number, pairs, launch_s = 0, sampling.block_pairs, 0.0
    stop: Stop | None = None
    overlap = sampling.overlap and sampling.launches > 1
    with Launches(launch, overlap, clock, sampling.replicas) as launches:
        while not state.decided:  # poll: launches until decided
            stop = _out_of(sampling, state.runs, number, pairs, launch_s, state.elapsed)
            if stop is not None:
                break
            first = len(state.runs.base)
            launch_s, cost_s, stop = state.launch(launches, number, pairs)
            number += 1
            pairs = sampling.next_block_pairs(cost_s, _pair_s(state.runs, first), len(state.runs.base), number)
            if number >= sampling.least_launches and len(state.runs.base) >= sampling.min_pairs:
                state.judge()
            if stop == Stop.TIME:
                break
    runs = state.runs
    return Comparison(
        len(runs.base),
        state.verdicts,
        state.unpaired,
        runs.samples([v.label for v in state.verdicts]),
        {"base": _peak_mb(runs.base), "head": _peak_mb(runs.head)},
        stop=Stop.DECIDED if state.decided else stop or Stop.PAIRS,
        launches=number,
        seconds=state.elapsed,
        overlapped=launches.overlapped,
        overlap_refused=launches.refused,
        replicas=sampling.replicas,
    )


@dataclass
class _Sampler:
    """What an A/B has gathered so far, and one launch block of it at a time."""

    sampling: Sampling
    tolerances: Tolerances
    on_pair: Callable[[int, int, FigureVerdict | None], None]
    clock: Callable[[], float]
    runs: _Runs = field(default_factory=_Runs)
    verdicts: list[FigureVerdict] = field(default_factory=list)
    unpaired: dict[str, str] = field(default_factory=dict)
    begun: float = field(init=False)

    def __post_init__(self) -> None:
        self.begun = self.clock()

    @property
    def elapsed(self) -> float:
        return self.clock() - self.begun

    @property
    def decided(self) -> bool:
        return bool(self.verdicts) and _decided(self.verdicts)

    def judge(self) -> None:
        self.verdicts, self.unpaired = self.runs.judge(self.tolerances, self.sampling.confidence)

    def launch(self, launches: Launches, number: int, pairs: int) -> tuple[float, float, Stop | None]:
        """Launch ``number``: every replica's sides started, warmed up (HEAD, then BASE: pair 0 starts with the side
        that ran last), the next launch started ahead (when overlapping), then its pairs, a pair on each replica in
        turn. Returns how long the sampler waited for the launch, how long a launch takes (its start wherever it
        ran, and its warm-up: it sizes the launches, so that an overlapped start ends with the launch before), and
        Stop.TIME where one launch ran out of time."""
        sampling, runs, first, started = self.sampling, self.runs, len(self.runs.base), self.clock()
        with launches.launch(number) as launch:
            warm = self.clock()
            for base, head in launch.replicas:
                for i in range(sampling.warmup):
                    head.run(placement=i)
                    base.run(placement=i)
            launch_s, cost_s = self.clock() - started, launch.start_s + self.clock() - warm
            if pairs < sampling.max_pairs - first:
                launches.start_ahead(number + 1)
            while len(runs.base) - first < min(pairs, sampling.max_pairs - first):
                _run_pair(launch, runs, len(runs.base) - first)
                self.on_pair(len(runs.base), number + 1, _e2e(self.verdicts))
                if sampling.launches > 1:
                    if number == 0:  # as long in pairs as its launch took, once a pair says what one costs
                        pairs = sampling.next_block_pairs(cost_s, _pair_s(runs, first), 0, 0)
                    continue
                if _judge_now(len(runs.base), sampling.min_pairs):
                    self.judge()
                    if self.decided:
                        break
                if self.elapsed + _pair_s(runs, first) > sampling.max_time_s:
                    return launch_s, cost_s, Stop.TIME
        return launch_s, cost_s, None


def _out_of(sampling: Sampling, runs: _Runs, number: int, pairs: int, launch_s: float, elapsed: float) -> Stop | None:
    """Whether launch ``number`` fits: under ``max_pairs`` (a launch cut below the first one's size would weigh as
    much as a whole one in the interval over blocks, so it is not started) and, as dear as the last one, ending
    within ``max_time_s``."""
    if number == 0:
        return None
    left = sampling.max_pairs - len(runs.base)
    if left <= 0 or sampling.launches == 1 or (number >= sampling.least_launches and left < sampling.block_pairs):
        return Stop.PAIRS
    if elapsed + launch_s + min(pairs, left) * _pair_s(runs, 0) > sampling.max_time_s:
        return Stop.TIME
    return None


def _judge_now(pairs: int, min_pairs: int) -> bool:
    """One launch block is judged after every pair up to EXACT_PAIRS, then as the pairs grow by a twentieth (a judgement
    sorts every figure's n(n + 1) / 2 Walsh averages)."""
    return pairs >= min_pairs and (pairs <= EXACT_PAIRS or pairs % max(1, pairs // 20) == 0)


def _pair_s(runs: _Runs, first: int) -> float:
    """What a pair of the last block took on parity's clock (both sides' runs), from pair ``first`` on."""
    pairs = list(zip(runs.base[first:], runs.head[first:]))
    return sum(b.wall_ms + h.wall_ms for b, h in pairs) / 1000 / len(pairs) if pairs else 0.0


def _run_pair(launch: Launch, runs: _Runs, j: int) -> None:
    """Pair ``j`` of a launch: on replica ``j % replicas`` (round the replicas a pair each), BASE first when it is
    that replica's even pair (ABBA), both runs on the same cores; recorded under the replica's launch block. A pair
    at a time, each side of a replica idles 2N - 1 and 2N + 1 runs before its two runs of a quartet alike, so a
    server's cooling while the others run cancels in the quartet (a quartet at a time it lands on one side)."""
    replicas = len(launch.replicas)
    replica, i = j % replicas, j // replicas
    (base, head), block = launch.replicas[replica], launch.block(replica)
    first, second = ((base, runs.base), (head, runs.head)) if i % 2 == 0 else ((head, runs.head), (base, runs.base))
    first[1].append(first[0].run(placement=i))
    second[1].append(second[0].run(placement=i))
    runs.block.append(block)


def _e2e(verdicts: Sequence[FigureVerdict]) -> FigureVerdict | None:
    return next((v for v in verdicts if v.label == E2E), None)
