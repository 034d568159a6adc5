"""Two sessions started at once, each kept by a thread of its own until it is closed and what it launched stopped.

A launch block of an A/B starts both sides afresh; two servers (a real model loads its weights for
minutes) started one after the other cost a block both starts, side by side only the slower one.
Each side is started, closed and stopped in the same thread: a launched server's keeper takes the
end of the thread that started it for parity's death (Linux's ``PR_SET_PDEATHSIG`` follows the
thread), so that thread lives until the server is stopped. Rank pools are not started this way.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence

from harness.pipelines.sessions import Session


def start_side_by_side(
    stack: contextlib.ExitStack,
    order: Sequence[str],
    start: Callable[[str], Session],
    stop: Callable[[str], None],
) -> dict[str, Session]:
    """Every side's session started at once, each by an :class:`_Owner` thread that ``stack`` ends (closing it, then
    ``stop(side)``: what the side launched); the first failure is raised once every start has ended."""
    owners = {
        side: _Owner(functools.partial(start, side), functools.partial(stop, side), f"parity-launch-{side}")
        for side in order
    }
    for owner in owners.values():
        owner.thread.start()
    for owner in owners.values():
        owner.ready.wait()
        if owner.session is not None:
            stack.callback(owner.finish)
        else:  # it failed: its thread stops what it launched and ends
            owner.thread.join()
    failed = next((o.error for o in owners.values() if o.error is not None), None)
    if failed is not None:
        raise failed
    return {side: owner.session for side, owner in owners.items() if owner.session is not None}


class _Owner:
    """A daemon thread that starts one session, keeps it until :meth:`finish`, then closes it and calls ``stop``. A
    launched server's keeper takes the end of the thread that started it for parity's death (Linux's parent-death
    signal follows the thread), so that thread lives until the server is stopped; on Ctrl-C parity exits without
    waiting for it."""

    def __init__(self, start: Callable[[], Session], stop: Callable[[], None], name: str) -> None:
        self._begin, self._end, self.ready, self._done = start, stop, threading.Event(), threading.Event()
        self.session: Session | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._own, daemon=True, name=name)

    def _own(self) -> None:
        try:
            self.session = self._begin()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by _started_together
            self.error = exc
        self.ready.set()
        if self.session is not None:
            self._done.wait()
            try:
                self.session.close()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by finish
                self.error = exc
        try:
            self._end()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by finish
            self.error = self.error or exc

    def finish(self) -> None:
        """Close the session in its thread and wait for that; its failure, if any, is raised here."""
        self._done.set()
        self.thread.join()
        if self.error is not None:
            raise self.error
