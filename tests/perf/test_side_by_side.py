"""Two sides of a launch block that run outside rank groups start side by side (``start_side_by_side``): each in a
thread that also closes and stops it, since a launched server's keeper takes the end of the thread that started it
for parity's death. Checked with sessions that record their threads: no wall-clock bound."""

from __future__ import annotations

import contextlib
import threading

import pytest

from harness.pipelines.side_by_side import start_side_by_side


class Recorded:
    """A session that notes the thread it was started, closed and stopped in."""

    def __init__(self, side: str, log: list[tuple[str, str, str]]) -> None:
        self.side, self.log = side, log
        log.append(("start", side, threading.current_thread().name))

    def close(self) -> None:
        self.log.append(("close", self.side, threading.current_thread().name))

    def __enter__(self) -> Recorded:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def test_both_sides_start_at_once_and_each_ends_in_the_thread_that_started_it() -> None:
    """A barrier that both starts must reach before either returns: started one after the other, the first would wait
    for the second in vain (the barrier breaks after 60 s and the test fails)."""
    log: list[tuple[str, str, str]] = []
    both = threading.Barrier(2, timeout=60)

    def start(side: str) -> Recorded:
        both.wait()
        return Recorded(side, log)

    def stop(side: str) -> None:
        log.append(("stop", side, threading.current_thread().name))

    with contextlib.ExitStack() as stack:
        sessions = start_side_by_side(stack, ("base", "head"), start, stop)  # type: ignore[arg-type]
        assert set(sessions) == {"base", "head"} and not any(event == "close" for event, _, _ in log)
    threads = {side: {thread for _, s, thread in log if s == side} for side in ("base", "head")}
    assert threads == {"base": {"parity-launch-base"}, "head": {"parity-launch-head"}}, log
    assert [event for event, side, _ in log if side == "base"] == ["start", "close", "stop"]


def test_a_side_that_fails_to_start_is_raised_and_the_other_is_closed_and_stopped() -> None:
    log: list[tuple[str, str, str]] = []

    def start(side: str) -> Recorded:
        if side == "head":
            raise RuntimeError("the server exited before it was ready")
        return Recorded(side, log)

    def stop(side: str) -> None:
        log.append(("stop", side, threading.current_thread().name))

    with pytest.raises(RuntimeError, match="exited before it was ready"), contextlib.ExitStack() as stack:
        start_side_by_side(stack, ("base", "head"), start, stop)  # type: ignore[arg-type]
    events = [(event, side) for event, side, _ in log]
    assert ("start", "base") in events and ("close", "base") in events
    assert {("stop", "base"), ("stop", "head")} <= set(events)  # what the failed side launched is stopped too
