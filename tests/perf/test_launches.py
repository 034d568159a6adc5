"""Launch blocks one after the other or overlapped (harness.perf.launches), with launchers whose starts and ends are
logged and, where a test needs it, held on an event: the next block starts while this one runs, never two ahead, a
start that failed beside a live block is retried once that block has ended, nothing started is left alive."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.perf.launches import Launches, Runner
from harness.pipelines.sessions import TimedRun
from harness.targets.base import Timings


class LoggedLauncher:
    """Blocks whose start and end are logged (``start 1``, ``end 1``); ``fail`` lists blocks whose start fails while
    another block is alive (as four servers that do not fit), ``gate`` holds every start until it is set."""

    def __init__(self, fail: tuple[int, ...] = ()) -> None:
        self.log: list[str] = []
        self.alive: set[int] = set()
        self.most_alive = 0
        self.fail, self.gate, self.lock = fail, threading.Event(), threading.Condition()  # notified as blocks start
        self.gate.set()

    @contextlib.contextmanager
    def __call__(self, block: int) -> Iterator[tuple[Runner, Runner]]:
        self.gate.wait(timeout=30)
        with self.lock:
            if block in self.fail and self.alive:
                self.log.append(f"refused {block}")
                raise RuntimeError("out of device memory")
            self.log.append(f"start {block}")
            self.alive.add(block)
            self.most_alive = max(self.most_alive, len(self.alive))
            self.lock.notify_all()
        try:
            yield object(), object()  # type: ignore[misc] - the sides are never run here
        finally:
            with self.lock:
                self.log.append(f"end {block}")
                self.alive.discard(block)


def _run_blocks(launcher: LoggedLauncher, overlap: bool, blocks: int) -> tuple[Launches, list[bool]]:
    """``blocks`` blocks as the sampler takes them, each one's next started ahead once its sides are up; and which
    blocks counted as started while the block before ran."""
    overlapped = []
    with Launches(launcher, overlap, time.perf_counter) as launches:
        for block in range(blocks):
            before = launches.overlapped
            with launches.launch(block):
                overlapped.append(launches.overlapped > before)
                launches.start_ahead(block + 1)
                launcher.log.append(f"pairs {block}")
    return launches, overlapped


def test_one_after_the_other_one_block_is_alive_at_a_time() -> None:
    launcher = LoggedLauncher()
    launches, overlapped = _run_blocks(launcher, overlap=False, blocks=3)
    assert launcher.log == ["start 0", "pairs 0", "end 0", "start 1", "pairs 1", "end 1", "start 2", "pairs 2", "end 2"]
    assert launches.overlapped == 0 and overlapped == [False] * 3 and launcher.most_alive == 1


def test_overlapped_the_next_block_starts_before_this_one_ends_and_the_last_ahead_is_ended() -> None:
    launcher = LoggedLauncher()
    launches, overlapped = _run_blocks(launcher, overlap=True, blocks=3)
    log = launcher.log  # each block's sides were up before the block before ended:
    assert all(log.index(f"start {block + 1}") < log.index(f"end {block}") for block in range(3)), log
    assert log.count("start 3") == log.count("end 3") == 1  # started ahead, never used: ended, not left alive
    assert launches.overlapped == 2 and overlapped == [False, True, True]
    assert launcher.most_alive == 2 and not launcher.alive


def test_a_start_that_fails_beside_a_live_block_is_retried_alone_and_the_rest_go_one_after_the_other() -> None:
    launcher = LoggedLauncher(fail=(2,))
    launches, overlapped = _run_blocks(launcher, overlap=True, blocks=4)
    log = launcher.log
    assert overlapped == [False, True, False, False]
    assert log.index("refused 2") < log.index("end 1") < log.index("start 2")  # retried once block 1 had ended
    assert log.index("end 2") < log.index("start 3")  # overlapping given up for the blocks after it
    assert launches.refused is not None and "launch 3 failed while launch 2 was alive" in launches.refused
    assert "out of device memory" in launches.refused and not launcher.alive


def test_a_start_that_fails_alone_is_raised() -> None:
    launcher = LoggedLauncher(fail=(0,))
    launcher.alive.add(-1)  # something else holds the device: even the first start fails
    with pytest.raises(RuntimeError, match="out of device memory"):
        with Launches(launcher, True, time.perf_counter) as launches, launches.launch(0):
            pass


def test_a_block_still_starting_at_the_end_is_waited_for_and_ended() -> None:
    launcher = LoggedLauncher()
    with Launches(launcher, True, time.perf_counter) as launches:
        with launches.launch(0):
            launcher.gate.clear()  # block 1's start hangs until released
            launches.start_ahead(1)
        threading.Timer(0.05, launcher.gate.set).start()
    assert launcher.log[-2:] == ["start 1", "end 1"] and not launcher.alive


def test_overlapped_or_not_an_ab_takes_the_same_pairs_to_the_same_verdict() -> None:
    """Scripted sessions (a 3 % spread, no difference): overlapping changes when the sides start, not what is
    sampled or judged."""
    from harness.baselines.perf import DEFAULT_AB_TOLERANCES
    from harness.perf.ab import compare
    from harness.perf.sampling import Sampling
    from tests.perf.test_ab_stats import ScriptedSession

    def ab(overlap: bool) -> tuple[int, int, int, list[str]]:
        @contextlib.contextmanager
        def launch(block: int) -> Iterator[tuple[Runner, Runner]]:
            yield ScriptedSession("B", [10.0, 10.3], []), ScriptedSession("H", [10.3, 10.0], [])

        sampling = Sampling(warmup=1, min_pairs=12, max_pairs=200, launches=3, overlap=overlap)
        comparison = compare(launch, sampling, DEFAULT_AB_TOLERANCES)
        statuses = [f"{v.label} {v.status}" for v in comparison.verdicts]
        return comparison.pairs, comparison.launches, comparison.overlapped, statuses

    one_by_one, overlapped = ab(False), ab(True)
    assert overlapped[:2] == one_by_one[:2] and overlapped[3] == one_by_one[3]
    assert (one_by_one[2], overlapped[2]) == (0, overlapped[1] - 1) and "expected_e2e_ms passed" in overlapped[3]


class ThreadClock:
    """A scripted clock per thread: a start run ahead moves only its own thread's time, as a start hidden behind
    the pairs costs the sampler nothing."""

    def __init__(self) -> None:
        self._now: dict[int, float] = {}

    @property
    def now(self) -> float:
        return self._now.get(threading.get_ident(), 0.0)

    @now.setter
    def now(self, value: float) -> None:
        self._now[threading.get_ident()] = value

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("overlap", "seconds", "overlapped"), [(False, 66.0, 0), (True, 46.0, 2)], ids=["one-by-one", "overlapped"]
)
def test_blocks_are_sized_by_the_start_wherever_it_ran_and_the_time_counts_only_what_the_sampler_waited(
    overlap: bool, seconds: float, overlapped: int
) -> None:
    """Starts of 10 s and runs of 1 s: every block is sized to 10 / 2 pairs (6 in whole quartets), whether the start
    ran in the sampler's thread or ahead in its own; the sampler's time holds each start one after the other
    (3 x 10 + 18 x 2 = 66 s), overlapped only the first (10 + 36 = 46 s)."""
    from harness.baselines.perf import DEFAULT_AB_TOLERANCES
    from harness.perf.ab import compare
    from harness.perf.sampling import Sampling
    from tests.perf.test_ab_stats import ClockedSession

    clock = ThreadClock()

    @contextlib.contextmanager
    def launch(block: int) -> Iterator[tuple[Runner, Runner]]:
        clock.now += 10.0  # in the thread that starts the block
        yield ClockedSession("B", [10.0], clock, 1000.0), ClockedSession("H", [10.0], clock, 1000.0)  # type: ignore[arg-type]

    sampling = Sampling(warmup=0, min_pairs=10, max_pairs=40, launches=3, overlap=overlap)
    comparison = compare(launch, sampling, DEFAULT_AB_TOLERANCES, clock=clock)
    launches = comparison.samples["expected_e2e_ms"]["launch"]
    assert [launches.count(b) for b in range(comparison.launches)] == [6, 6, 6]
    assert (comparison.seconds, comparison.overlapped) == (seconds, overlapped)


def _run_launches(launcher: LoggedLauncher, overlap: bool, replicas: int, count: int) -> list[list[int]]:
    """``count`` launches of ``replicas`` as the sampler takes them; each one's blocks as it handed them out."""
    handed = []
    with Launches(launcher, overlap, time.perf_counter, replicas) as launches:
        for number in range(count):
            with launches.launch(number) as launch:
                handed.append([launch.block(r) for r in range(len(launch.replicas))])
                launches.start_ahead(number + 1)
                launcher.log.append(f"pairs {number}")
    return handed


@pytest.mark.parametrize(("overlap", "most_alive"), [(False, 3), (True, 6)], ids=["one-by-one", "overlapped"])
def test_a_launch_of_replicas_starts_every_block_before_its_pairs_and_ends_them_all(
    overlap: bool, most_alive: int
) -> None:
    launcher = LoggedLauncher()
    handed = _run_launches(launcher, overlap, replicas=3, count=2)
    log = launcher.log
    assert handed == [[0, 1, 2], [3, 4, 5]]
    assert all(log.index(f"start {b}") < log.index("pairs 0") for b in (0, 1, 2)), log
    assert all(log.index(f"start {b}") < log.index("pairs 1") for b in (3, 4, 5)), log
    assert launcher.most_alive == most_alive and not launcher.alive


class LastToStart(LoggedLauncher):
    """Block ``last`` starts only once every other block of its launch is alive (so that they are when it fails)."""

    def __init__(self, fail: tuple[int, ...], last: int, others: int) -> None:
        super().__init__(fail)
        self.last, self.others = last, others

    def __call__(self, block: int) -> contextlib.AbstractContextManager[tuple[Runner, Runner]]:
        if block == self.last:  # in its own start thread: the others start meanwhile
            with self.lock:
                assert self.lock.wait_for(lambda: len(self.alive) >= self.others, timeout=30), (
                    "the others never started"
                )
        return super().__call__(block)


def test_a_replica_that_fails_to_start_ends_the_replicas_that_did_and_is_raised() -> None:
    launcher = LastToStart(fail=(1,), last=1, others=2)
    with pytest.raises(RuntimeError, match="out of device memory"):
        _run_launches(launcher, overlap=False, replicas=3, count=1)
    assert "pairs 0" not in launcher.log and not launcher.alive
    assert sorted(e for e in launcher.log if e.startswith("start")) == ["start 0", "start 2"]


def test_pairs_rotate_over_the_replicas_a_pair_at_a_time_each_block_in_abba_order() -> None:
    """Three replicas: blocks 0, 1, 2 take a pair each in turn, each block's own pairs alternating BASE first and
    HEAD first; every instance is warmed up before the first pair."""
    from harness.baselines.perf import DEFAULT_AB_TOLERANCES
    from harness.perf.ab import compare
    from harness.perf.sampling import Sampling
    from tests.perf.test_ab_stats import ScriptedSession

    logs: dict[int, list[str]] = {}

    @contextlib.contextmanager
    def launch(block: int) -> Iterator[tuple[Runner, Runner]]:
        log = logs.setdefault(block, [])
        yield ScriptedSession("B", [10.0, 10.2], log), ScriptedSession("H", [10.1, 10.0], log)

    sampling = Sampling(warmup=1, min_pairs=24, max_pairs=48, launches=2, replicas=3)
    comparison = compare(launch, sampling, DEFAULT_AB_TOLERANCES)
    blocks = comparison.samples["expected_e2e_ms"]["launch"]
    assert blocks[:12] == [0, 1, 2] * 4 and set(blocks) == set(range(3 * comparison.launches))
    assert all("".join(log[2:]).startswith("BHHBBHHB") for log in logs.values()), logs
    assert all(log[:2] == ["H", "B"] for log in logs.values()) and comparison.replicas == 3


@pytest.mark.parametrize(
    ("replicas", "cost_s", "pairs"),
    [(1, 30.0, 30), (3, 30.0, 30), (3, 3.0, 12), (3, 200.0, 96), (2, 9.0, 12)],
    ids=["one", "three", "min-pairs-at-least", "capped-per-replica", "rounded-up-to-quartets"],
)
def test_a_launch_of_replicas_runs_whole_quartets_on_each_about_as_long_as_its_start(
    replicas: int, cost_s: float, pairs: int
) -> None:
    from harness.perf.sampling import Sampling

    sampling = Sampling(min_pairs=10, max_pairs=1000, launches=3, replicas=replicas)
    assert sampling.next_block_pairs(cost_s, 1.0, 100, 5) == pairs


class CoolingSession:
    """A server that cools while others run: a run after two or more runs elsewhere takes 110 ms (its caches and
    threads gone cold), else 100 ms; every session of one A/B counts runs on one shared tally."""

    def __init__(self, tally: list[int]) -> None:
        self.tally, self.last = tally, -100

    def run(self, keep_output: bool = False, placement: int | None = None) -> TimedRun:
        idle, self.last = self.tally[0] - self.last, self.tally[0]
        self.tally[0] += 1
        e2e = 110.0 if idle > 2 else 100.0
        return TimedRun(Timings(e2e, {}, []), e2e, (), "not_measured")


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_server_cooling_while_the_other_replicas_run_lands_on_both_sides_alike(replicas: int) -> None:
    """Identical sides, every run's time set by how long its server idled: a pair at a time round the replicas, each
    side idles as long as the other over a quartet, so every quartet reads exactly 1.0 (a quartet at a time round
    them, BASE would cool more and read slower)."""
    from harness.baselines.perf import DEFAULT_AB_TOLERANCES
    from harness.perf.ab import compare
    from harness.perf.sampling import Sampling

    tally = [0]

    @contextlib.contextmanager
    def launch(block: int) -> Iterator[tuple[Runner, Runner]]:
        yield CoolingSession(tally), CoolingSession(tally)

    sampling = Sampling(warmup=1, min_pairs=24, max_pairs=48, launches=2, replicas=replicas)
    e2e = compare(launch, sampling, DEFAULT_AB_TOLERANCES).verdict("expected_e2e_ms")
    assert e2e is not None and e2e.interval is not None
    assert (e2e.interval.low, e2e.interval.high) == (pytest.approx(1.0), pytest.approx(1.0))


@pytest.mark.parametrize(
    ("launches", "replicas", "least", "pairs"),
    [(3, 1, 3, 4), (3, 3, 1, 12), (4, 3, 2, 6), (3, 2, 2, 8)],
    ids=["3-launches", "3-replicas-once", "4-instances-in-2-launches", "3-instances-in-2-launches"],
)
def test_each_side_starts_afresh_launches_times_before_a_verdict_replicas_at_a_launch(
    launches: int, replicas: int, least: int, pairs: int
) -> None:
    """``--launches`` counts instances started afresh: three replicas are three, so one launch of them is judged
    (10 pairs at least over the launches owed, whole quartets on every replica)."""
    from harness.perf.sampling import Sampling

    sampling = Sampling(min_pairs=10, launches=launches, replicas=replicas)
    assert (sampling.least_launches, sampling.block_pairs) == (least, pairs)


class TallySession:
    """A side that logs where in the launch's run sequence each of its runs came (no timing of its own)."""

    def __init__(self, name: str, tally: list[tuple[str, int]]) -> None:
        self.name, self.tally = name, tally

    def run(self, keep_output: bool = False, placement: int | None = None) -> TimedRun:
        self.tally.append((self.name, placement or 0))
        return TimedRun(Timings(100.0, {}, []), 100.0, (), "not_measured")


@settings(max_examples=30, deadline=None)
@given(replicas=st.integers(1, 6), quartets=st.integers(2, 4))
def test_round_the_replicas_each_block_runs_abba_and_both_sides_idle_alike_over_a_quartet(
    replicas: int, quartets: int
) -> None:
    """Any replica count: every block gets its whole quartets in ABBA order, and past its first quartet each side of
    a replica idles as long as the other before its two runs of a quartet (what lets a cooling server cancel)."""
    from harness.perf.ab import _run_pair, _Runs
    from harness.perf.launches import Launch

    tally: list[tuple[str, int]] = []
    sides = [(TallySession(f"B{r}", tally), TallySession(f"H{r}", tally)) for r in range(replicas)]
    runs = _Runs()
    for j in range(2 * quartets * replicas):
        _run_pair(Launch(0, sides, 0.0), runs, j)  # type: ignore[arg-type]
    orders = {"".join(name[0] for name, _ in tally if name[1:] == str(r)) for r in range(replicas)}
    at = {name: [i for i, (n, _) in enumerate(tally) if n == name] for name, _ in tally}  # each side's positions
    idle = {name: [b - a for a, b in zip(p, p[1:])] for name, p in at.items()}  # before its runs 2, 3, ...
    unlike = [  # the idles before quartet q's two runs of each side of replica r, where they differ
        (r, q)
        for r in range(replicas)
        for q in range(1, quartets)
        if sorted(idle[f"B{r}"][2 * q - 1 : 2 * q + 1]) != sorted(idle[f"H{r}"][2 * q - 1 : 2 * q + 1])
    ]
    assert sorted(runs.block) == sorted(list(range(replicas)) * 2 * quartets)
    assert orders == {"BHHB" * quartets} and unlike == [], (orders, unlike, idle)
