"""One live rank group per world size, started in the background and shared by every case that needs it.

Starting a group costs seconds (every rank imports torch); a case in a live group costs
milliseconds. A :class:`PoolSet` starts the groups a run will need at once, in background
threads, hands out each group when a case asks for it and closes the groups (in the
background too) when told: after a world size's last case (:meth:`release`) or at the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future

from harness.ranks.launcher import RankPool


class PoolSet:
    """Lazily started, background-started, background-closed pools, one per world size."""

    def __init__(self, device: str = "cpu", timeout: float = 120.0) -> None:
        self.device = device
        self.timeout = timeout
        self.startup_s: dict[int, float] = {}  # how long each group took to start (reports show it apart from cases)
        self._starting: dict[int, Future[RankPool]] = {}
        self._closers: list[threading.Thread] = []

    def prestart(self, world_sizes: Iterable[int]) -> None:
        for world in sorted(set(world_sizes)):
            if world not in self._starting:
                future: Future[RankPool] = Future()
                self._starting[world] = future
                threading.Thread(target=self._start, args=(world, future), daemon=True, name=f"pool-start-{world}").start()

    def _start(self, world: int, future: Future[RankPool]) -> None:
        start = time.perf_counter()
        try:
            pool = RankPool(world, self.device, self.timeout)
            self.startup_s[world] = time.perf_counter() - start
            future.set_result(pool)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for this pool
            future.set_exception(exc)

    def get(self, world: int) -> RankPool:
        self.prestart([world])
        return self._starting[world].result()

    def release(self, world: int) -> None:
        """Close the pool of ``world`` in the background (closing a group takes seconds)."""
        future = self._starting.pop(world, None)
        if future is None:
            return
        thread = threading.Thread(target=_close_when_started, args=(future,), daemon=True, name=f"pool-close-{world}")
        thread.start()
        self._closers.append(thread)

    def close(self) -> None:
        for world in list(self._starting):
            self.release(world)
        for thread in self._closers:
            thread.join()
        self._closers.clear()

    def terminate(self) -> None:
        """End every group now; a group still starting is ended as soon as it has started."""
        for future in self._starting.values():
            future.add_done_callback(_terminate_when_started)
        self._starting.clear()

    def __enter__(self) -> PoolSet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.terminate()


def _close_when_started(future: Future[RankPool]) -> None:
    try:
        pool = future.result()
    except BaseException:  # noqa: BLE001 - a pool that never started has nothing to close
        return
    pool.close()


def _terminate_when_started(future: Future[RankPool]) -> None:
    if future.exception() is None:  # a pool that never started has nothing to end
        future.result().terminate()
