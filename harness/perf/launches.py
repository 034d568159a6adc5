"""An A/B's launch blocks, one after the other or overlapped: the next block's sides started in a thread of its own
while this block's pairs run, so that a launch costs its warm-up instead of its start (a served model loads its
weights for seconds to minutes, a block of 0.2 s requests lasts about as long).

Overlapping keeps both blocks' sides alive at once (four servers): for a machine with cores and device memory to
spare, and the starting sides share the machine with the pairs being timed (both sides of every pair alike, ABBA).
A start that fails while the block before is alive is tried again once that block has ended (four did not fit), and
the blocks after it start one after the other; :attr:`Launches.refused` says why.
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


#: ``launch(i)``: both sides started afresh for launch block ``i`` (BASE first when ``i`` is even), ended on exit.
Launcher = Callable[[int], AbstractContextManager[tuple[Runner, Runner]]]


@dataclass(frozen=True)
class Launch:
    """Launch block ``block``'s two sides, started, and how long starting them took wherever it ran."""

    base: Runner
    head: Runner
    start_s: float  # from the start's beginning until both sides were ready
    overlapped: bool  # started while the block before ran its pairs


class _Start:
    """One launch block being started (in a daemon thread of its own when ``behind``), then held until closed."""

    def __init__(self, launch: Launcher, block: int, clock: Callable[[], float], behind: bool) -> None:
        self.block, self.behind, self._launch, self._clock = block, behind, launch, clock
        self._stack = contextlib.ExitStack()
        self.sides: tuple[Runner, Runner] | None = None
        self.error: BaseException | None = None
        self.start_s = 0.0
        self._thread = (
            threading.Thread(target=self._start, daemon=True, name=f"parity-block-{block}") if behind else None
        )
        if self._thread is not None:
            self._thread.start()
        else:
            self._start()

    def _start(self) -> None:
        began = self._clock()
        try:
            self.sides = self._stack.enter_context(self._launch(self.block))
        except BaseException as exc:  # noqa: BLE001 - raised in the sampler's thread by wait()
            self.error = exc
        self.start_s = self._clock() - began

    def wait(self) -> tuple[Runner, Runner]:
        """Both sides once started (the start's failure raised here)."""
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.sides is not None
        return self.sides

    def close(self) -> None:
        """End both sides (a start still under way is waited for first: its sides are ended, not left behind)."""
        if self._thread is not None:
            self._thread.join()
        self._stack.close()


class Launches:
    """Launch blocks as the sampler asks for them, the next one started ahead when ``overlap`` (module docstring)."""

    def __init__(self, launch: Launcher, overlap: bool, clock: Callable[[], float]) -> None:
        self._launch, self.overlap, self._clock = launch, overlap, clock
        self._ahead: _Start | None = None
        self.overlapped = 0  # blocks whose sides started while the block before ran
        self.refused: str | None = None  # why overlapping was given up, if it was

    @contextlib.contextmanager
    def block(self, block: int) -> Iterator[Launch]:
        """Block ``block``'s sides: the ones started ahead, else started now; ended on exit."""
        start, self._ahead = self._ahead, None
        assert start is None or start.block == block, "a block started ahead is the next one asked for"
        if start is None:
            start = _Start(self._launch, block, self._clock, behind=False)
        try:
            base, head = start.wait()
        except Exception as exc:
            if not start.behind:
                raise
            start.close()
            self.overlap = False
            self.refused = f"launch {block + 1} failed while launch {block} was alive ({exc}); started alone instead"
            start = _Start(self._launch, block, self._clock, behind=False)
            base, head = start.wait()
        self.overlapped += start.behind
        try:
            yield Launch(base, head, start.start_s, start.behind)
        finally:
            start.close()

    def start_ahead(self, block: int) -> None:
        """Start block ``block``'s sides now, in a thread, for :meth:`block` to take (when overlapping)."""
        if self.overlap and self._ahead is None:
            self._ahead = _Start(self._launch, block, self._clock, behind=True)

    def __enter__(self) -> Launches:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """A block started ahead and never used is ended; on Ctrl-C it is not waited for (its thread dies with
        parity, and a launched server's keeper with it)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (kind is None or issubclass(kind, Exception)):
            ahead.close()
