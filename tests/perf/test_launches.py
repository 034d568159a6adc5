"""Launch blocks one after the other or overlapped (harness.perf.launches), with launchers whose starts and ends are
logged and, where a test needs it, held on an event: the next block starts while this one runs, never two ahead, a
start that failed beside a live block is retried once that block has ended, nothing started is left alive."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from harness.perf.launches import Launches, Runner


class LoggedLauncher:
    """Blocks whose start and end are logged (``start 1``, ``end 1``); ``fail`` lists blocks whose start fails while
    another block is alive (as four servers that do not fit), ``gate`` holds every start until it is set."""

    def __init__(self, fail: tuple[int, ...] = ()) -> None:
        self.log: list[str] = []
        self.alive: set[int] = set()
        self.most_alive = 0
        self.fail, self.gate, self.lock = fail, threading.Event(), threading.Lock()
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
        try:
            yield object(), object()  # type: ignore[misc] - the sides are never run here
        finally:
            with self.lock:
                self.log.append(f"end {block}")
                self.alive.discard(block)


def _run_blocks(launcher: LoggedLauncher, overlap: bool, blocks: int) -> tuple[Launches, list[bool]]:
    """``blocks`` blocks as the sampler takes them, each one's next started ahead once its sides are up; and which
    blocks said they had started while the block before ran."""
    overlapped = []
    with Launches(launcher, overlap, time.perf_counter) as launches:
        for block in range(blocks):
            with launches.block(block) as launch:
                overlapped.append(launch.overlapped)
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
        with Launches(launcher, True, time.perf_counter) as launches, launches.block(0):
            pass


def test_a_block_still_starting_at_the_end_is_waited_for_and_ended() -> None:
    launcher = LoggedLauncher()
    with Launches(launcher, True, time.perf_counter) as launches:
        with launches.block(0):
            launcher.gate.clear()  # block 1's start hangs until released
            launches.start_ahead(1)
        threading.Timer(0.05, launcher.gate.set).start()
    assert launcher.log[-2:] == ["start 1", "end 1"] and not launcher.alive


def test_overlapped_or_not_an_ab_takes_the_same_pairs_to_the_same_verdict() -> None:
    """Scripted sessions (a 3 % spread, no difference): overlapping changes when the sides start, not what is
    sampled or judged."""
    from harness.baselines.perf import DEFAULT_AB_TOLERANCES
    from harness.perf.ab import Sampling, compare
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
    from harness.perf.ab import Sampling, compare
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
