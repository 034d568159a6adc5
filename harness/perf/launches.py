"""An A/B's launches, one after the other or overlapped: the next launch's sides started in threads of their own
while this launch's pairs run, so that a launch costs its warm-up instead of its start (a served model loads its
weights for seconds to minutes, a block of 0.2 s requests lasts about as long).

A launch starts ``replicas`` instances of each side at once, each pair a launch block of its own: a server's bias and
slow spells are its own, so one start's wait gives N block estimates. Overlapping keeps two launches alive at once:
for a machine with cores and device memory to spare (the starting sides load both sides of every pair alike, ABBA).
A start that fails while the launch before is alive is tried again once that launch has ended (they did not fit),
and the launches after it start one after the other; :attr:`Launches.refused` says why.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from harness.pipelines.sessions import TimedRun


class Runner(Protocol):
    """One side of an A/B in one launch: a prepared pipeline that runs when asked (:class:`Session`)."""

    def run(self, keep_output: bool = False, placement: int | None = None) -> TimedRun: ...


#: ``launch(block)``: both sides started afresh for launch block ``block`` (BASE first when ``block`` is even), ended
#: on exit; launch ``n`` of ``r`` replicas holds blocks ``n * r`` to ``n * r + r - 1``.
Launcher = Callable[[int], AbstractContextManager[tuple[Runner, Runner]]]


@dataclass(frozen=True)
class Launch:
    """Launch ``number``'s replicas (BASE and HEAD each, started), and how long starting them took wherever it ran."""

    number: int
    replicas: list[tuple[Runner, Runner]]
    start_s: float  # from the start's beginning until every side was ready

    def block(self, replica: int) -> int:
        """The launch block of ``replica``: each instance pair's estimate is one of the interval's."""
        return self.number * len(self.replicas) + replica


class _Start:
    """One launch block being started (in a daemon thread of its own when ``threaded``), then held until closed."""

    def __init__(self, launch: Launcher, block: int, clock: Callable[[], float], threaded: bool) -> None:
        self._launch, self._block, self._clock = launch, block, clock
        self._stack = contextlib.ExitStack()
        self.sides: tuple[Runner, Runner] | None = None
        self.error: BaseException | None = None
        self.start_s = 0.0
        self._thread = threading.Thread(target=self._start, daemon=True, name=f"parity-block-{block}")
        if threaded:
            self._thread.start()
        else:
            self._start()

    def _start(self) -> None:
        began = self._clock()
        try:
            self.sides = self._stack.enter_context(self._launch(self._block))
        except BaseException as exc:  # noqa: BLE001 - raised in the sampler's thread by _Group.wait()
            self.error = exc
        self.start_s = self._clock() - began

    def join(self) -> None:
        if self._thread.is_alive():
            self._thread.join()

    def close(self) -> None:
        """End both sides (a start still under way is waited for first: its sides are ended, not left behind)."""
        self.join()
        self._stack.close()


class _Group:
    """One launch's blocks, all started at once (each in a thread of its own when ``threaded``)."""

    def __init__(self, launch: Launcher, number: int, replicas: int, clock: Callable[[], float], ahead: bool) -> None:
        self.number, self.ahead = number, ahead
        threaded = ahead or replicas > 1
        self.starts = [_Start(launch, number * replicas + r, clock, threaded) for r in range(replicas)]

    def wait(self) -> Launch:
        """Every replica once started (the first start's failure raised here, once all have ended their start)."""
        for start in self.starts:
            start.join()
        error = next((s.error for s in self.starts if s.error is not None), None)
        if error is not None:
            raise error
        sides = [s.sides for s in self.starts if s.sides is not None]
        assert len(sides) == len(self.starts)
        return Launch(self.number, sides, max(s.start_s for s in self.starts))

    def close(self) -> None:
        for start in reversed(self.starts):
            start.close()


class Launches:
    """Launches as the sampler asks for them, the next one started ahead when ``overlap`` (module docstring)."""

    def __init__(self, launch: Launcher, overlap: bool, clock: Callable[[], float], replicas: int = 1) -> None:
        self._launch, self.overlap, self._clock, self.replicas = launch, overlap, clock, replicas
        self._ahead: _Group | None = None
        self.overlapped = 0  # launches whose sides started while the launch before ran
        self.refused: str | None = None  # why overlapping was given up, if it was

    def _group(self, number: int, ahead: bool) -> _Group:
        return _Group(self._launch, number, self.replicas, self._clock, ahead)

    @contextlib.contextmanager
    def launch(self, number: int) -> Iterator[Launch]:
        """Launch ``number``'s sides: the ones started ahead, else started now; ended on exit."""
        group, self._ahead = self._ahead, None
        assert group is None or group.number == number, "a launch started ahead is the next one asked for"
        group = group or self._group(number, ahead=False)
        try:
            launch = self._waited(group)
        except Exception as exc:
            if not group.ahead:
                raise
            self.overlap = False
            self.refused = f"launch {number + 1} failed while launch {number} was alive ({exc}); started alone instead"
            group = self._group(number, ahead=False)
            launch = self._waited(group)
        self.overlapped += group.ahead
        try:
            yield launch
        finally:
            group.close()

    @staticmethod
    def _waited(group: _Group) -> Launch:
        """``group`` once started; a failed start ends the replicas that did start before it is raised (on Ctrl-C
        nothing is waited for: see :meth:`__exit__`)."""
        try:
            return group.wait()
        except Exception:
            group.close()
            raise

    def start_ahead(self, number: int) -> None:
        """Start launch ``number``'s sides now, in threads, for :meth:`launch` to take (when overlapping)."""
        if self.overlap and self._ahead is None:
            self._ahead = self._group(number, ahead=True)

    def __enter__(self) -> Launches:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """A launch started ahead and never used is ended; on Ctrl-C it is not waited for (its threads die with
        parity, and a launched server's keeper with it)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (kind is None or issubclass(kind, Exception)):
            ahead.close()
