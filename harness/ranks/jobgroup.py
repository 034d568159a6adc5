"""Rank 0's handle on one group of a job: job ranks 0..W-1, one rank each, with a local group's interface.

Under a job a :class:`~harness.ranks.launcher.RankPool` starts a :class:`JobGroup` where it would
start a local :class:`~harness.ranks.group.Group`, so every caller of a pool (the contract runner,
the image and perf stages, bless, sweep) runs on the job's ranks unchanged. A case's group is its
own process group of exactly W ranks, whatever the job's size, so targets set up their parallel
state on the default group as under the local launcher. A failure says what the local launcher
says; a job rank that stops answering ends the run with :class:`~harness.ranks.control.JobLost`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from harness.ranks.control import Abort, Call, JobLost, Start, Stop
from harness.ranks.group import FailureKind, RankFailure, call_name, describe_failure, pickle_call, timed_out
from harness.ranks.session import JobSession
from harness.ranks.starting import preloaded_modules

# A job rank answers within this of its own rank's timeout (the stack dump and the reaping included).
_ANSWER_GRACE_S = 20.0


class JobGroup:
    """Job ranks ``0..world_size-1`` of ``session``'s job, each running its rank of one group, joined and ready."""

    def __init__(
        self,
        session: JobSession,
        backend: str,
        devices: Sequence[str],
        world_size: int,
        startup_timeout: float,
        method: str,
    ) -> None:
        self._session = session
        self._world = world_size
        self._calls = 0
        self._alive = True
        self.id = session.new_group_id(world_size)
        session.post(Start(self.id, world_size, backend, tuple(devices), startup_timeout, method, preloaded_modules()))
        self._collect("start", startup_timeout, "group start")

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def pids(self) -> list[int]:
        return []  # the rank processes belong to the job's ranks, on their own hosts

    def call(self, fn: Callable[..., Any], args: Sequence[Any], timeout: float) -> list[Any]:
        """``fn(*args)`` on every rank; the results in rank order, or RankFailure with the group ended."""
        payload, what = pickle_call(fn, args), call_name(fn)
        self._calls += 1
        step = f"c{self._calls}"
        self._session.post(Call(self.id, step, payload, timeout, what))
        return self._collect(step, timeout, what)

    def close(self) -> None:
        self._end(now=False)

    def terminate(self) -> None:
        self._end(now=True)

    def _end(self, now: bool) -> None:
        if self._alive:
            self._alive = False
            self._session.post(Stop(self.id, now))

    def _collect(self, step: str, timeout: float, what: str) -> list[Any]:
        """Every job rank's answer to ``step``; the values in rank order, or the failure, the group ended."""
        inbox = self._session.inbox
        deadline = time.monotonic() + timeout + _ANSWER_GRACE_S
        aborted = False
        try:
            with inbox.changed:
                while len(answers := dict(inbox.answers(self.id, step))) < self._world:
                    if not aborted and any(answer.failure is not None for _, answer in answers.values()):
                        self._session.post(Abort(self.id, step))  # the others end their rank now, not at their timeout
                        aborted = True
                    inbox.check()
                    if time.monotonic() > deadline:
                        missing = [r for r in range(self._world) if r not in answers]
                        raise JobLost(
                            f"job rank(s) {', '.join(map(str, missing))} sent no answer to {what} "
                            f"{_ANSWER_GRACE_S:g} s after its {timeout:g} s timeout"
                        )
                    inbox.wait()
        except BaseException:
            self.terminate()
            raise
        finally:
            inbox.forget(self.id, step)
        failures = [answer.failure for _, answer in sorted(answers.values(), key=lambda a: a[0]) if answer.failure]
        if failures:
            self.terminate()  # the ranks that answered stay no more alive than under the local launcher
            raise combined(failures, timeout, what)
        return [answers[rank][1].value for rank in range(self._world)]


def combined(failures: Sequence[RankFailure], timeout: float, what: str) -> RankFailure:
    """One error for the failures of several job ranks (in the order they failed), blamed as a local group blames:
    a rank that died, else the rank that raised first; timeouts only when nothing broke; ranks ended because
    another failed are no failure of their own."""
    broke = [f for f in failures if f.kind in (FailureKind.RAISED, FailureKind.DIED)]
    if len(broke) == 1:
        return broke[0]
    if broke:
        return describe_failure([(_rank(f), f.kind is FailureKind.DIED, f.traceback) for f in broke], what)
    hung = [f for f in failures if f.kind is FailureKind.TIMEOUT]
    if len(hung) == 1:
        return hung[0]
    if hung:
        return timed_out({_rank(f): f.traceback for f in hung}, timeout, what)
    return failures[0]


def _rank(failure: RankFailure) -> int:
    assert failure.rank is not None, "a job rank's failure names its rank"
    return failure.rank
