"""The A/B verdict's statistics against independent oracles: the signed-rank distribution by brute force and
by the published critical values, the Hodges-Lehmann estimate by numpy, coverage by simulation; the sampling
loop (ABBA order, stopping, unpaired figures) with scripted sessions."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

from harness.baselines.perf import DEFAULT_AB_TOLERANCES
from harness.perf.ab import Comparison, FigureStatus, FigureVerdict, Stop, compare, judge_figure
from harness.perf.launches import Runner
from harness.perf.sampling import Sampling
from harness.perf.stats import (
    EXACT_PAIRS,
    MAX_PAIRS,
    RatioInterval,
    _log_estimate,
    _signed_rank_counts,
    blocked_ratio,
    min_pairs,
    paired_ratio,
    trimmed_per_side,
)
from harness.pipelines.sessions import TimedRun
from harness.targets import Timings


@pytest.mark.parametrize("n", range(1, 13))
def test_the_signed_rank_distribution_is_the_count_of_sign_patterns(n: int) -> None:
    sums = Counter(
        sum(rank for rank, on in zip(range(1, n + 1), signs) if on) for signs in itertools.product((0, 1), repeat=n)
    )
    assert _signed_rank_counts(n) == tuple(sums[t] for t in range(n * (n + 1) // 2 + 1))


# Two-sided 5 % critical values of Wilcoxon's T (the largest T with P(T <= T) <= 0.025), as printed in the tables
@pytest.mark.parametrize(
    ("n", "critical"),
    [
        (6, 0),
        (7, 2),
        (8, 3),
        (9, 5),
        (10, 8),
        (11, 10),
        (12, 13),
        (13, 17),
        (14, 21),
        (15, 25),
        (16, 29),
        (17, 34),
        (18, 40),
        (19, 46),
        (20, 52),
        (25, 89),
        (30, 137),
    ],
)
def test_the_interval_trims_the_published_critical_value_plus_one(n: int, critical: int) -> None:
    assert trimmed_per_side(n, 0.95) == critical + 1


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.996])
def test_past_the_exact_table_the_normal_approximation_trims_as_the_exact_distribution_would(confidence: float) -> None:
    """At 240 pairs (past EXACT_PAIRS) the approximation's trim, judged by the exact distribution built here as the
    oracle: its coverage is the one asked for (to 1e-3), and it is within 0.2 % of the exact trim."""
    n = 240
    assert n > EXACT_PAIRS
    counts = _signed_rank_counts(n)
    allowed = (1.0 - confidence) / 2.0 * 2**n
    exact = next(k for k in range(len(counts)) if sum(counts[: k + 1]) > allowed)
    approximate = trimmed_per_side(n, confidence)
    assert abs(approximate - exact) <= 0.002 * exact
    assert 1.0 - 2.0 * sum(counts[:approximate]) / 2**n == pytest.approx(confidence, abs=1e-3)


@pytest.mark.parametrize(("confidence", "fewest"), [(0.9, 5), (0.95, 6), (0.99, 8)])
def test_the_fewest_pairs_for_an_interval(confidence: float, fewest: int) -> None:
    assert min_pairs(confidence) == fewest and trimmed_per_side(fewest - 1, confidence) == 0


def test_the_estimate_is_the_median_of_walsh_averages_and_the_interval_inverts_the_ratio() -> None:
    rng = np.random.default_rng(7)
    base = list(rng.uniform(9, 11, 15))
    head = list(np.array(base) * rng.lognormal(0.05, 0.04, 15))
    got = paired_ratio(base, head, 0.95)
    assert got is not None
    logs = np.log(np.array(head) / np.array(base))
    walsh = sorted((logs[i] + logs[j]) / 2 for i in range(15) for j in range(i, 15))
    assert got.ratio == pytest.approx(math.exp(np.median(walsh)))
    k = 25 + 1  # n = 15
    assert (got.low, got.high) == (pytest.approx(math.exp(walsh[k - 1])), pytest.approx(math.exp(walsh[-k])))
    assert got.low <= got.ratio <= got.high and got.coverage >= 0.95
    swapped = paired_ratio(head, base, 0.95)
    assert swapped is not None
    assert (swapped.ratio, swapped.low, swapped.high) == (
        pytest.approx(1 / got.ratio),
        pytest.approx(1 / got.high),
        pytest.approx(1 / got.low),
    )


@pytest.mark.parametrize("noise", ["lognormal", "exponential"])
def test_the_interval_covers_the_true_ratio_at_least_as_often_as_promised(noise: str) -> None:
    """Each side's runs drawn with the same noise (skewed too: a pair's log ratio is then symmetric, which is
    what the signed-rank interval needs); HEAD truly 8 % slower."""
    rng = np.random.default_rng(2026)
    covered, trials, n = 0, 600, 12
    for _ in range(trials):  # repeats: Monte Carlo trials of one interval

        def runs(scale: float) -> np.ndarray:
            jitter = rng.lognormal(0, 0.1, n) if noise == "lognormal" else 1 + rng.exponential(0.2, n)
            return scale * jitter

        got = paired_ratio(list(runs(10.0)), list(runs(10.8)), 0.95)
        assert got is not None
        covered += got.low <= 1.08 <= got.high
    assert covered / trials >= 0.93  # exact coverage 0.958 at n = 12; 600 trials have a standard error of 0.008


@pytest.mark.parametrize(
    ("base", "head", "status"),
    [
        ([10.0] * 10, [11.0 + 0.01 * i for i in range(10)], FigureStatus.FAILED),  # 10 % slower: beyond 5 %
        ([10.0] * 10, [10.0 + 0.01 * (-1) ** i for i in range(10)], FigureStatus.PASSED),  # equal within noise
        ([10.0] * 10, [9.0, 11.6] * 5, FigureStatus.UNDECIDED),  # the interval straddles 1.05
        ([10.0] * 5, [10.0] * 5, FigureStatus.UNDECIDED),  # too few pairs for a 95 % interval
        ([0.2] * 10, [0.3] * 10, FigureStatus.PASSED),  # 0.1 ms slower, under the 0.5 ms floor: limit 1 + 0.5 / 0.2
    ],
    ids=["slower", "equal", "straddles", "too-few", "under-the-floor"],
)
def test_a_figure_is_judged_by_its_interval_against_its_limit(
    base: list[float], head: list[float], status: FigureStatus
) -> None:
    verdict = judge_figure("expected_e2e_ms", [base], [head], DEFAULT_AB_TOLERANCES, 0.95)
    assert verdict.status == status
    assert verdict.limit == pytest.approx(1 + max(0.05, 0.5 / verdict.base_ms))


def test_a_failure_is_claimed_over_every_figure_judged() -> None:
    """Beyond the limit at 95 % for one figure, but not at 1 - 0.05/10 for one of ten: undecided, not failed."""
    base, head = [10.0] * 12, [10.4, 11.5, 10.3, 11.8, 10.9, 11.2, 10.5, 11.6, 10.8, 11.1, 10.4, 11.4]
    alone = judge_figure("expected_e2e_ms", [base], [head], DEFAULT_AB_TOLERANCES, 0.95)
    among_ten = judge_figure("expected_e2e_ms", [base], [head], DEFAULT_AB_TOLERANCES, 0.95, figures=10)
    assert alone.status == FigureStatus.FAILED and among_ten.status == FigureStatus.UNDECIDED
    assert among_ten.interval == alone.interval and among_ten.interval is not None and among_ten.interval.low > 1.05
    assert among_ten.claim is not None and among_ten.claim.low < 1.05 and among_ten.claim.coverage >= 0.995
    assert "not beyond it at the 99.5% a claim over every figure needs: 1.040" in among_ten.describe()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_pairs": 5}, "min_pairs must be between 6"),
        (
            {"min_pairs": 20, "max_pairs": 10},
            r"min_pairs must be between 6 \(at confidence 0.95\) and max_pairs \(10\)",
        ),
        ({"max_pairs": 1001}, "max_pairs must be at most 1000"),
        ({"max_time_s": 0.0}, "max_time must be > 0 seconds"),
        ({"warmup": -1}, "warmup must be >= 0"),
        ({"confidence": 1.0}, "confidence must be in"),
        ({"replicas": 9}, "replicas must be between 1 and 8"),
        ({"replicas": 8, "launches": 9, "max_pairs": 30}, r"8 x 2 launches need 32 pairs at least"),
    ],
    ids=[
        "min-below-an-interval",
        "min-above-max",
        "max-above-parity-s-most",
        "no-time",
        "negative-warmup",
        "confidence-one",
        "replicas-above-8",
        "replicas-beyond-max-pairs",
    ],
)
def test_sampling_refuses_what_cannot_give_a_verdict(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--max-pairs", "1001"], "--max-pairs"),
        (["--min-pairs", "5"], "--min-pairs"),
        (["--min-pairs", "30", "--max-pairs", "20"], "--min-pairs"),
        (["--confidence", "0.4"], "--confidence"),
        (["--max-time", "0"], "--max-time"),
        (["--replicas", "0"], "--replicas"),
        (["--replicas", "9"], "--replicas"),
    ],
    ids=["max-above-1000", "min-below-6", "min-above-max", "confidence-low", "no-time", "no-replica", "replicas-9"],
)
def test_a_sampling_option_out_of_range_is_named(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.cli import main

    assert main(["perf", "reference", "reference", *argv]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's usage above it names every option
    assert option in said and (option == "--min-pairs" or "--min-pairs" not in said), said


class ScriptedSession:
    """A session whose runs' timings come from ``times`` (ms, cycled), logging which side ran."""

    def __init__(
        self, name: str, times: list[float], log: list[str], stages: tuple[str, ...] = ("DenoisingStage",)
    ) -> None:
        self.name, self.times, self.log, self.stages, self.i = name, times, log, stages, 0

    def run(self, placement: int | None = None) -> TimedRun:
        e2e = self.times[self.i % len(self.times)]
        self.i += 1
        self.log.append(self.name)
        return TimedRun(
            Timings(e2e, {s: e2e / 2 for s in self.stages}, [e2e / 4, e2e / 4]), e2e + 1.0, (), "not_measured"
        )


def same(base: Runner, head: Runner) -> object:
    """A launcher that hands out the same two sessions at every launch (``launches=1``: one launch)."""

    @contextlib.contextmanager
    def launch(block: int) -> Iterator[tuple[Runner, Runner]]:
        yield base, head

    return launch


def test_runs_alternate_in_abba_order_after_the_warm_up_and_stop_once_decided() -> None:
    log: list[str] = []
    comparison = compare(
        same(ScriptedSession("B", [10.0], log), ScriptedSession("H", [10.0], log)),
        Sampling(warmup=2, min_pairs=6, max_pairs=50, launches=1),
        DEFAULT_AB_TOLERANCES,
    )
    assert log[:4] == ["H", "B", "H", "B"]  # warm-up, ending with BASE: pair 0 starts with the side that ran last
    assert "".join(log[4:]) == "BH" + "HB" + "BH" + "HB" + "BH" + "HB"  # ABBA: drift lands on both sides alike
    assert comparison.pairs == 6 and not comparison.capped and not comparison.failed and not comparison.undecided
    assert len(comparison.samples["expected_e2e_ms"]["base"]) == 6


def test_an_undecided_figure_runs_to_the_cap_and_a_failed_one_stops_at_once() -> None:
    log: list[str] = []
    undecided = compare(
        same(ScriptedSession("B", [10.0], log), ScriptedSession("H", [9.0, 11.6], log)),
        Sampling(warmup=0, min_pairs=6, max_pairs=9, launches=1),
        DEFAULT_AB_TOLERANCES,
    )
    assert undecided.pairs == 9 and undecided.capped and undecided.undecided and not undecided.failed
    slower = compare(
        same(ScriptedSession("B", [10.0], log), ScriptedSession("H", [12.0], log)),
        Sampling(warmup=0, min_pairs=6, max_pairs=50, launches=1),
        DEFAULT_AB_TOLERANCES,
    )
    # 7 figures (wall, e2e, the stage, 2 steps, their average and median): a failure is claimed at 1 - 0.05/7,
    # whose interval needs 9 pairs; every pair reads exactly 1.2, so the 9th fails the figures beyond their limits
    assert slower.pairs == min_pairs(1 - 0.05 / 7) == 9
    assert {v.label for v in slower.failed} >= {"expected_e2e_ms", "stages_ms.DenoisingStage"}


def test_figures_only_one_side_records_are_listed_not_judged() -> None:
    log: list[str] = []
    comparison = compare(
        same(
            ScriptedSession("B", [10.0], log, ("DenoisingStage", "TextEncodingStage")),
            ScriptedSession("H", [10.0], log, ("DenoisingStage", "PreparationStage")),
        ),
        Sampling(warmup=0, min_pairs=6, max_pairs=6, launches=1),
        DEFAULT_AB_TOLERANCES,
    )
    assert comparison.unpaired == {
        "stages_ms.PreparationStage": "recorded by HEAD only",
        "stages_ms.TextEncodingStage": "recorded by BASE only",
    }
    assert comparison.verdict("stages_ms.DenoisingStage") is not None
    assert comparison.verdict("stages_ms.TextEncodingStage") is None


class BiasedLaunches:
    """A launcher whose HEAD process of launch ``i`` runs ``biases[i]`` times as long as BASE (every pair alike):
    the process-level bias two launches of identical code show (memory layout, allocator, clocks)."""

    def __init__(self, biases: list[float], log: list[str]) -> None:
        self.biases, self.log = biases, log

    @contextlib.contextmanager
    def __call__(self, block: int) -> Iterator[tuple[Runner, Runner]]:
        self.log.append(f"launch {block}")
        bias = self.biases[block % len(self.biases)]
        yield ScriptedSession("B", [10.0, 10.1], self.log), ScriptedSession("H", [10.0 * bias, 10.1 * bias], self.log)


def test_one_launch_reads_its_process_bias_as_a_difference_and_launch_blocks_do_not() -> None:
    """BASE = HEAD code, each HEAD launch biased by up to 6 % either way: one launch per side claims a 6 % slowdown
    with its pairs' interval; launch blocks give an interval over the launches, which covers 1.0."""
    log: list[str] = []
    one = compare(BiasedLaunches([1.06], log), Sampling(min_pairs=10, max_pairs=20, launches=1), DEFAULT_AB_TOLERANCES)
    assert one.launches == 1 and one.failed, "a single launch's bias is claimed as a regression"
    blocks = compare(
        BiasedLaunches([1.06, 0.95, 1.02, 0.97, 1.01, 0.99], log),
        Sampling(warmup=0, min_pairs=12, max_pairs=60, launches=6),
        DEFAULT_AB_TOLERANCES,
    )
    e2e = blocks.verdict("expected_e2e_ms")
    assert not blocks.failed and e2e is not None and e2e.interval is not None
    assert e2e.interval.low < 1.0 < e2e.interval.high and blocks.launches >= 6
    assert log.count("launch 0") == 2 and "launch 5" in log
    assert blocks.samples["expected_e2e_ms"]["launch"][:4] == [0, 0, 1, 1]  # block_pairs = 12 / 6 = 2


def test_replicas_give_each_instance_pair_a_block_of_its_own() -> None:
    """Two launches of three replicas, each instance pair biased its own way: six blocks, as six launches give, and
    an interval over them that covers 1.0; every block started once."""
    log: list[str] = []
    comparison = compare(
        BiasedLaunches([1.06, 0.95, 1.02, 0.97, 1.01, 0.99], log),
        Sampling(warmup=0, min_pairs=12, max_pairs=60, launches=2, replicas=3),
        DEFAULT_AB_TOLERANCES,
    )
    e2e = comparison.verdict("expected_e2e_ms")
    assert e2e is not None and e2e.interval is not None and not comparison.failed
    assert e2e.interval.low < 1.0 < e2e.interval.high
    assert sorted(e for e in log if e.startswith("launch")) == [f"launch {b}" for b in range(3 * comparison.launches)]
    assert set(comparison.samples["expected_e2e_ms"]["launch"]) == set(range(3 * comparison.launches))


def test_a_slowdown_every_launch_shares_fails_through_launch_blocks() -> None:
    log: list[str] = []
    comparison = compare(
        BiasedLaunches([1.20, 1.22, 1.19, 1.21], log),
        Sampling(warmup=0, min_pairs=12, max_pairs=60, launches=3),
        DEFAULT_AB_TOLERANCES,
    )
    assert {v.label for v in comparison.failed} >= {"expected_e2e_ms"}
    assert not comparison.capped


def _blocks(ratios: list[float]) -> tuple[list[list[float]], list[list[float]]]:
    """Blocks of three pairs whose pairs agree: each block's Hodges-Lehmann estimate is its ratio."""
    base = [[10.0, 12.0, 11.0] for _ in ratios]
    return base, [[v * r for v in b] for b, r in zip(base, ratios)]


@pytest.mark.parametrize(
    "ratios",
    [[1.03, 0.98, 1.01, 0.97], [1.03, 0.98, 1.01, 0.97, 1.02, 0.99]],
    ids=["4-too-few-for-signed-rank", "6-signed-rank-only-min-to-max"],
)
def test_few_launch_blocks_get_student_t_over_their_estimates(ratios: list[float]) -> None:
    """Four blocks (too few for a 95 % signed-rank interval) or six (whose signed-rank interval is only [min, max],
    25 % wider than t's): scipy's one-sample t interval of their log ratios."""
    from scipy import stats

    base, head = _blocks(ratios)
    got = blocked_ratio(base, head, 0.95)
    assert got is not None
    low, high = stats.ttest_1samp(np.log(ratios), 0.0).confidence_interval(0.95)
    assert (math.log(got.low), math.log(got.high)) == pytest.approx((low, high), rel=1e-9)
    assert math.log(got.ratio) == pytest.approx(np.mean(np.log(ratios)))
    assert got.pairs == 3 * len(ratios) and blocked_ratio(base[:1], head[:1], 0.95) == paired_ratio(
        base[0], head[0], 0.95
    )


def test_blocks_that_agree_by_chance_do_not_narrow_the_interval_below_the_pairs_own() -> None:
    """Three blocks whose quartets scatter ±20 % around the same 1.01: Student's t over their three equal estimates has
    no width, the pairs pooled over the blocks do; the interval is theirs (the signed-rank interval of every block's
    quartet sums as the oracle), as it was for 3 of 40 runs on two cores whose intervals over blocks missed 1.0."""
    base = [[10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0]] * 3
    head = [[10.1 * f for f in (1.2, 1.2, 1 / 1.2, 1 / 1.2, 1.1, 1.1, 1 / 1.1, 1 / 1.1)]] * 3
    got = blocked_ratio(base, head, 0.95)
    units_b = [20.0] * 12
    units_h = [sum(h[i : i + 2]) for h in head for i in range(0, 8, 2)]
    pooled = paired_ratio(units_b, units_h, 0.95)
    assert got is not None and pooled is not None and got.low < got.ratio < got.high
    assert (got.low, got.high) == (pooled.low, pooled.high)
    assert got.ratio == pytest.approx(math.exp(_log_estimate(base[0], head[0])))


def test_enough_launch_blocks_get_the_signed_rank_interval_which_an_outlier_block_moves_little() -> None:
    """Sixteen blocks: the signed-rank interval over their estimates (the pairs' own function as the oracle); one
    block three times as slow (a burst of load) stays outside it, where it widens Student's t past the limit."""
    from scipy import stats

    ratios = [1.01, 0.99, 1.02, 0.98, 1.00, 1.01, 0.99, 1.0] * 2
    ratios[-1] = 3.0
    got = blocked_ratio(*_blocks(ratios), 0.95)
    oracle = paired_ratio([1.0] * 16, ratios, 0.95)
    assert (
        got is not None
        and oracle is not None
        and (got.low, got.ratio, got.high) == (oracle.low, oracle.ratio, oracle.high)
    )
    t_high = math.exp(stats.ttest_1samp(np.log(ratios), 0.0).confidence_interval(0.95)[1])
    assert got.high < 1.05 < t_high


@pytest.mark.parametrize(
    ("launches", "min_pairs", "block"), [(1, 10, 60), (3, 10, 4), (5, 10, 2), (6, 12, 2), (2, 7, 4)]
)
def test_pairs_are_spread_over_the_launches_in_whole_abba_quartets(launches: int, min_pairs: int, block: int) -> None:
    assert Sampling(min_pairs=min_pairs, max_pairs=60, launches=launches).block_pairs == block


class CarryOver:
    """Two identical servers on shared cores: a run right after the same server's run is fast (its threads still
    hot), one after the other server's is slow (the other's threads still spinning), as measured with two torch
    servers on two cores (pair ratios 0.55 and 1.8 by position in the quartet)."""

    def __init__(self) -> None:
        self.last: str | None = None

    def session(self, name: str) -> Runner:
        owner = self

        class Session:
            def run(self, keep_output: bool = False, placement: int | None = None) -> TimedRun:
                ms = 8.0 if owner.last == name else 12.0
                owner.last = name
                return TimedRun(Timings(ms, {}, []), ms, (), "not_measured")

        return Session()

    @contextlib.contextmanager
    def __call__(self, block: int) -> Iterator[tuple[Runner, Runner]]:
        self.last = None  # fresh servers
        yield self.session("B"), self.session("H")


def test_the_carry_over_from_the_previous_run_cancels_in_every_block() -> None:
    """Every pair's second run follows the other side; its first follows itself once the warm-up ends with BASE, so
    each side is fast and slow equally often in every quartet and identical sides read exactly 1."""
    comparison = compare(CarryOver(), Sampling(warmup=1, min_pairs=12, max_pairs=12, launches=3), DEFAULT_AB_TOLERANCES)
    e2e = comparison.verdict("expected_e2e_ms")
    assert e2e is not None and e2e.interval is not None and e2e.interval.ratio == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("launch_s", "pair_s", "pairs_done", "blocks_done", "max_pairs", "block"),
    [
        (2.4, 0.05, 4, 1, 200, 32),  # the built-in 1-rank case on 2 cores: launches dear, pairs cheap
        (30.0, 4.0, 4, 1, 200, 8),  # a real pipeline: a pair costs an eighth of a launch
        (0.5, 0.02, 4, 1, 200, 4),  # launches cheap (under dear_launch_s): the first block's size
        (2.4, 0.05, 4, 1, 20, 8),  # room under max_pairs for the two blocks still owed: (20 - 4) / 2
        (2.4, 0.05, 36, 3, 200, 32),  # the owed launches are in: only the cap
    ],
    ids=["cheap-pairs", "dear-pairs", "free-launches", "blocks-owed", "past-the-owed"],
)
def test_a_block_times_pairs_about_as_long_as_its_launch_took(
    launch_s: float, pair_s: float, pairs_done: int, blocks_done: int, max_pairs: int, block: int
) -> None:
    sampling = Sampling(min_pairs=10, max_pairs=max_pairs, launches=3)
    assert sampling.next_block_pairs(launch_s, pair_s, pairs_done, blocks_done) == block


class Clock:
    """A clock that only the scripted runs and launches move."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ClockedSession(ScriptedSession):
    """A scripted session whose every run moves ``clock`` by the run's wall time (``wall_ms``, else the script's)."""

    def __init__(self, name: str, times: list[float], clock: Clock, wall_ms: float | None = None) -> None:
        super().__init__(name, times, [])
        self.clock, self.wall_ms = clock, wall_ms

    def run(self, keep_output: bool = False, placement: int | None = None) -> TimedRun:
        timed = super().run(placement=placement)
        wall_ms = timed.wall_ms if self.wall_ms is None else self.wall_ms
        self.clock.now += wall_ms / 1000
        return TimedRun(timed.timings, wall_ms, (), "not_measured")


def test_blocks_grow_with_what_a_launch_costs() -> None:
    """Launches of 0.1 s (dear here) against pairs of 22 ms on a scripted clock size every block to 0.1 / 0.022 pairs
    rounded up to whole quartets (6): the first too, past the 4 that spread min_pairs over the launches, once a pair
    says what one costs."""
    clock = Clock()

    @contextlib.contextmanager
    def launch(block: int) -> Iterator[tuple[Runner, Runner]]:
        clock.now += 0.1
        yield ClockedSession("B", [10.0], clock), ClockedSession("H", [10.0], clock)

    sampling = Sampling(warmup=0, min_pairs=10, max_pairs=40, launches=3, dear_launch_s=0.05)
    comparison = compare(launch, sampling, DEFAULT_AB_TOLERANCES, clock=clock)
    launches = comparison.samples["expected_e2e_ms"]["launch"]
    assert [launches.count(b) for b in range(comparison.launches)] == [6, 6, 6]


def _verdict(ratio: float, low: float, high: float, claim_low: float, limit: float = 1.05) -> FigureVerdict:
    interval = RatioInterval(ratio, low, high, 0.95, 100)
    claim = RatioInterval(ratio, claim_low, high, 0.995, 100)
    return FigureVerdict("expected_e2e_ms", 10.0, 10.0 * ratio, limit, interval, claim, FigureStatus.UNDECIDED)


@pytest.mark.parametrize(
    ("verdict", "needed"),
    [
        # below the limit: its interval's top end would meet it at 100 * (log 1.06 / log 1.05)^2 pairs, a fifth more
        (_verdict(1.0, 0.95, 1.06, 0.93), math.ceil(1.2 * 100 * (math.log(1.06) / math.log(1.05)) ** 2)),
        # above it: its claim's low end, (log 1.08 - log 1.02) against (log 1.08 - log 1.05)
        (
            _verdict(1.08, 1.04, 1.12, 1.02),
            math.ceil(1.2 * 100 * ((math.log(1.08) - math.log(1.02)) / (math.log(1.08) - math.log(1.05))) ** 2),
        ),
        (_verdict(1.05, 1.0, 1.1, 0.98), MAX_PAIRS + 1),  # on the limit: no number of pairs moves it off
        (_verdict(1.0, 0.6, 1.6, 0.5), MAX_PAIRS + 1),  # this noisy: beyond parity's most
    ],
    ids=["below-the-limit", "above-it", "on-it", "beyond-the-most"],
)
def test_the_pairs_that_would_decide_an_open_figure_scale_with_its_interval(
    verdict: FigureVerdict, needed: int
) -> None:
    comparison = Comparison(100, [verdict], {}, {}, stop=Stop.PAIRS)
    assert comparison.pairs_to_decide() == needed


def test_no_block_is_started_that_would_end_past_the_time_allowed() -> None:
    """Launches of 10 s and runs of 1 s against 60 s: blocks as long in pairs as a launch (5 pairs, 6 in whole
    quartets: 22 s) while one ends in time: after the second (44 s) a third would end at 66 s, so sampling stops on
    time with a launch owed, undecided."""
    clock = Clock()

    @contextlib.contextmanager
    def launch(block: int) -> Iterator[tuple[Runner, Runner]]:
        clock.now += 10.0
        yield ClockedSession("B", [10.0], clock, 1000.0), ClockedSession("H", [10.0], clock, 1000.0)

    sampling = Sampling(warmup=0, min_pairs=10, max_pairs=200, max_time_s=60.0, launches=3)
    comparison = compare(launch, sampling, DEFAULT_AB_TOLERANCES, clock=clock)
    assert (comparison.stop, comparison.pairs, comparison.launches, comparison.seconds) == (Stop.TIME, 12, 2, 44.0)
    assert comparison.capped and not comparison.verdicts  # three launches owed: nothing judged


def test_one_launch_stops_before_a_pair_that_would_end_past_the_time_allowed() -> None:
    clock = Clock()
    sampling = Sampling(warmup=0, min_pairs=6, max_pairs=200, max_time_s=30.0, launches=1)
    sides = ClockedSession("B", [10.0], clock, 1000.0), ClockedSession("H", [9.0, 11.6], clock, 1000.0)
    comparison = compare(same(*sides), sampling, DEFAULT_AB_TOLERANCES, clock=clock)
    assert (comparison.stop, comparison.pairs) == (Stop.TIME, 15)  # pair 16 would end at 32 s: not started
    assert comparison.undecided and comparison.seconds == 30.0


@pytest.mark.parametrize(
    ("per_run", "in_ranks", "launches", "replicas", "overlap"),
    [(False, False, 3, 2, True), (False, True, 3, 1, False), (True, False, 1, 1, True)],
    ids=["servers", "rank-groups", "a-process-per-run"],
)
def test_a_case_launches_replicas_and_overlaps_only_sides_run_outside_rank_groups(
    per_run: bool, in_ranks: bool, launches: int, replicas: int, overlap: bool
) -> None:
    """Rank pools beside a timed one would share its cores: one replica, one launch at a time; a process per run is
    a launch per run already."""
    from harness.gate.perf import _case_sampling

    asked = Sampling(launches=3, replicas=2, overlap=True)
    got = _case_sampling(asked, per_run, in_ranks)
    assert (got.launches, got.replicas, got.overlap) == (launches, replicas, overlap)
