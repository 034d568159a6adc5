"""How much slower HEAD is than BASE, from paired runs: a ratio with a confidence interval.

Each pair is one BASE and one HEAD run back to back (ABBA), so slow drift cancels in their ratio.
The estimate is the Hodges-Lehmann location of the paired log ratios (the median of their Walsh
averages), its interval the one the Wilcoxon signed-rank test inverts to, computed exactly. It needs
no normality (run times are skewed, with outliers), a third of the pairs can be outliers before it
moves, the interval is exact at every n rather than resampled, and it is deterministic, so a
verdict repeats for the same numbers. Logs make the ratio symmetric: ×2 and ×½ are equally far from 1.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

METHOD = "Hodges-Lehmann ratio of paired runs, Wilcoxon signed-rank interval (exact to 200 pairs, normal beyond)"
BLOCK_METHOD = (
    "Hodges-Lehmann ratio of each launch block's paired runs, signed-rank (few blocks: Student t) interval over the "
    "blocks' estimates, at least as wide as the pooled quartets'"
)
EXACT_PAIRS = 200  # the exact null distribution of n pairs takes O(n^3) steps to build: 0.3 s at 200
MAX_PAIRS = 1000  # beyond EXACT_PAIRS the signed-rank sum's normal approximation (its tail error < 1e-4 there)


@dataclass(frozen=True)
class RatioInterval:
    """``ratio`` = HEAD / BASE, with ``low <= ratio <= high`` at ``coverage`` (at least the confidence asked for)."""

    ratio: float
    low: float
    high: float
    coverage: float
    pairs: int


_COUNTS: list[tuple[int, ...]] = [(1,)]  # _COUNTS[n]: the signed-rank null distribution of n pairs


def _signed_rank_counts(n: int) -> tuple[int, ...]:
    """How many of the 2^n sign patterns give each signed-rank sum T = 0 .. n(n+1)/2 (exact integers)."""
    while len(_COUNTS) <= n:
        m = len(_COUNTS)  # adding rank m: every pattern either leaves it out or adds m to its sum
        previous = _COUNTS[-1]
        counts = list(previous) + [0] * m
        for total, ways in enumerate(previous):
            counts[total + m] += ways
        _COUNTS.append(tuple(counts))
    return _COUNTS[n]


def trimmed_per_side(n: int, confidence: float) -> int:
    """How many Walsh averages the interval drops at each end: the largest k with P(T <= k - 1) <= alpha / 2
    under the signed-rank null (0: n is too small for an interval at this confidence); past EXACT_PAIRS by the
    normal approximation of T with its continuity correction."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not 0 <= n <= MAX_PAIRS:
        raise ValueError(f"pairs must be in [0, {MAX_PAIRS}], got {n}")
    if n > EXACT_PAIRS:
        z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2.0)
        mean, sd = _signed_rank_moments(n)
        return max(0, math.floor(mean + 0.5 - z * sd))
    counts = _signed_rank_counts(n)
    allowed = (1.0 - confidence) / 2.0 * 2**n
    k, tail = 0, 0
    while k < len(counts) and tail + counts[k] <= allowed:
        tail += counts[k]
        k += 1
    return k


def _signed_rank_moments(n: int) -> tuple[float, float]:
    """The mean and standard deviation of the signed-rank sum T of n pairs under the null."""
    return n * (n + 1) / 4.0, math.sqrt(n * (n + 1) * (2 * n + 1) / 24.0)


def _coverage(n: int, k: int) -> float:
    if n > EXACT_PAIRS:
        mean, sd = _signed_rank_moments(n)
        return 1.0 - 2.0 * statistics.NormalDist().cdf((k - 0.5 - mean) / sd)
    counts = _signed_rank_counts(n)
    return 1.0 - 2.0 * sum(counts[:k]) / 2**n


def walsh_averages(values: Sequence[float]) -> list[float]:
    """Every ``(x_i + x_j) / 2`` for ``i <= j``, sorted: n(n+1)/2 of them (half a million at 1000 pairs)."""
    x = np.asarray(values, dtype=np.float64)
    upper = np.triu_indices(len(x))
    return np.sort((x[upper[0]] + x[upper[1]]) / 2.0).tolist()


def min_pairs(confidence: float) -> int:
    """The fewest pairs for which an interval at ``confidence`` exists (6 at 95 %)."""
    n = 1
    while trimmed_per_side(n, confidence) == 0:
        n += 1
    return n


def paired_ratio(base: Sequence[float], head: Sequence[float], confidence: float) -> RatioInterval | None:
    """HEAD / BASE from paired positive timings (None when there are too few pairs for an interval)."""
    if len(base) != len(head):
        raise ValueError(f"{len(base)} BASE values for {len(head)} HEAD values: runs come in pairs")
    if any(not (math.isfinite(v) and v > 0) for v in (*base, *head)):
        raise ValueError("paired timings must be finite and positive")
    n = len(base)
    k = trimmed_per_side(n, confidence)
    if k == 0:
        return None
    logs = [math.log(h / b) for b, h in zip(base, head)]
    walsh = walsh_averages(logs)
    return RatioInterval(
        math.exp(statistics.median(walsh)), math.exp(walsh[k - 1]), math.exp(walsh[-k]), _coverage(n, k), n
    )


def _units(base: Sequence[float], head: Sequence[float]) -> list[tuple[float, float]]:
    """A block's ABBA quartets: pairs 2k and 2k + 1 summed per side (in a quartet each side runs once after itself and
    once after the other, so a carry-over cancels); an odd last pair counts alone."""
    return [(sum(base[i : i + 2]), sum(head[i : i + 2])) for i in range(0, len(base), 2)]


def _log_estimate(base: Sequence[float], head: Sequence[float]) -> float:
    """The Hodges-Lehmann estimate of the log ratios of a block's ABBA quartets."""
    return statistics.median(walsh_averages([math.log(h / b) for b, h in _units(base, head)]))


def blocked_ratio(
    base: Sequence[Sequence[float]], head: Sequence[Sequence[float]], confidence: float
) -> RatioInterval | None:
    """HEAD / BASE over launch blocks (each block: both sides' processes or servers started afresh, then pairs).

    A process carries a bias of its own (memory layout, allocator, clocks: ~5 % between two processes
    running identical code, measured on an H200) that every pair within its launch shares. Each block
    gives one robust estimate (the Hodges-Lehmann ratio of its ABBA quartets); the interval over them
    covers the launch-to-launch spread as one launch's pairs cannot: the Wilcoxon signed-rank one
    where there are blocks enough (an outlier block moves it little), else Student's t (K - 1 df).
    That spread only adds to the pairs' noise, so the interval is at least as wide as the one every
    block's quartets give pooled: a few blocks that agree by chance do not narrow it below the pairs'
    own (measured: 3 of 40 intervals over blocks on two cores missed 1.0 that way), and there is none
    while the quartets are too few for one at ``confidence`` (a failure claimed at a corrected confidence
    waits for them). One block: the pairs' own interval (:func:`paired_ratio`), the bias not covered.
    """
    if len(base) != len(head):
        raise ValueError(f"{len(base)} BASE blocks for {len(head)} HEAD blocks")
    if len(base) == 1:
        return paired_ratio(base[0], head[0], confidence)
    for b, h in zip(base, head):
        paired_ratio(b, h, 0.5)  # the same checks: pairs, positive and finite
    over = _over_blocks([_log_estimate(b, h) for b, h in zip(base, head)], confidence)
    units = [u for b, h in zip(base, head) for u in _units(b, h)]
    pooled = paired_ratio([b for b, _ in units], [h for _, h in units], confidence)
    if pooled is None:  # too few quartets for an interval at this confidence: none over the blocks either
        return None
    low, high = min(over.low, pooled.low), max(over.high, pooled.high)
    return RatioInterval(over.ratio, low, high, over.coverage, sum(len(b) for b in base))


def _over_blocks(estimates: list[float], confidence: float) -> RatioInterval:
    """The interval over K block estimates (logs): signed-rank where K allows one that trims more than the extremes
    (robust to an outlier block, 2-9 % wider than Student's t on normal estimates), else Student's t (the fewest
    blocks a signed-rank interval allows give only [min, max]: 25 % wider)."""
    k = len(estimates)
    if trimmed_per_side(k, confidence) > 1:
        over = paired_ratio([1.0] * k, [math.exp(e) for e in estimates], confidence)
        assert over is not None
        return over
    from scipy.stats import t as student_t

    mean = statistics.fmean(estimates)
    half = float(student_t.ppf(0.5 + confidence / 2.0, k - 1)) * statistics.stdev(estimates) / math.sqrt(k)
    return RatioInterval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), confidence, k)
