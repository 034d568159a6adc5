"""One live rank group per world size, started in the background and shared by every case that needs it.

Starting a group costs seconds (every rank imports torch); a case in a live group costs
milliseconds. A :class:`PoolSet` starts the groups a run will need at once, in background
threads, hands out each group when a case asks for it and closes the groups (in the
background too) when told: after a world size's last case (:meth:`release`) or at the end.
A ``tag`` keeps groups apart that must not share processes (the two sides of a perf A/B: each
holds its own prepared pipeline, and a side at another commit imports another ``reference_impl``).
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
        self.startup_s: dict[
            str, float
        ] = {}  # per pool_label: how long each group took to start (reports show it apart from cases)
        self._starting: dict[tuple[str, int], Future[RankPool]] = {}
        self._closers: list[threading.Thread] = []

    def prestart(self, world_sizes: Iterable[int], tag: str = "") -> None:
        for world in sorted(set(world_sizes)):
            if (tag, world) not in self._starting:
                future: Future[RankPool] = Future()
                self._starting[tag, world] = future
                threading.Thread(
                    target=self._start,
                    args=(tag, world, future),
                    daemon=True,
                    name=f"pool-start-{pool_label(world, tag)}",
                ).start()

    def _start(self, tag: str, world: int, future: Future[RankPool]) -> None:
        start = time.perf_counter()
        try:
            pool = RankPool(world, self.device, self.timeout)
            self.startup_s[pool_label(world, tag)] = time.perf_counter() - start
            future.set_result(pool)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for this pool
            future.set_exception(exc)

    def get(self, world: int, tag: str = "") -> RankPool:
        self.prestart([world], tag)
        return self._starting[tag, world].result()

    def release(self, world: int, tag: str = "") -> None:
        """Close the pool of ``world`` (and ``tag``) in the background (closing a group takes seconds)."""
        future = self._starting.pop((tag, world), None)
        if future is None:
            return
        thread = threading.Thread(
            target=_close_when_started, args=(future,), daemon=True, name=f"pool-close-{pool_label(world, tag)}"
        )
        thread.start()
        self._closers.append(thread)

    def close(self) -> None:
        for tag, world in list(self._starting):
            self.release(world, tag)
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


def pool_label(world: int, tag: str = "") -> str:
    """How reports name a pool: its world size, after its tag when it has one (``2``, ``perf-base:2``)."""
    return f"{tag}:{world}" if tag else str(world)


def _close_when_started(future: Future[RankPool]) -> None:
    try:
        pool = future.result()
    except BaseException:  # noqa: BLE001 - a pool that never started has nothing to close
        return
    pool.close()


def _terminate_when_started(future: Future[RankPool]) -> None:
    if future.exception() is None:  # a pool that never started has nothing to end
        future.result().terminate()
