"""Run a function on N ranks of a real torch.distributed process group on one host, or on N ranks of a job.

Parity checks must exercise the collectives production uses, so every rank is a real process in a
real group (gloo on CPU, NCCL with one GPU per rank). :mod:`harness.ranks.group` adds a CI gate's
robustness (a rendezvous that cannot collide, a timeout with the stacks of hung ranks, a failing
rank's traceback, every rank ended on any failure, no process left behind);
:mod:`harness.ranks.starting` the speed (ranks forked from a preloaded server). A :class:`RankPool`
keeps one group alive, so a small case costs milliseconds. Under torchrun or srun
(:mod:`harness.ranks.session`) a pool's group is W of the job's ranks (:mod:`harness.ranks.jobgroup`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from harness.ranks import starting
from harness.ranks import worker as _rank_worker
from harness.ranks.group import Group, RankFailure
from harness.ranks.job import current_job
from harness.ranks.jobgroup import JobGroup
from harness.ranks.session import active_session

__all__ = ["RankFailure", "RankPool", "choose_backend", "rank_device", "run_on_ranks"]

# A group's start can include the preloaded server's first imports (a heavy target's among
# them) on a loaded 2-core CI box, so a short per-call timeout must not also bound the start.
_MIN_STARTUP_TIMEOUT_S = 60.0


def choose_backend(device: str, world_size: int) -> tuple[str, list[str]]:
    """Pick the process-group backend and each rank's device for ``world_size`` ranks on this host.

    NCCL needs one GPU per rank; with fewer GPUs than ranks every rank shares one GPU over
    gloo (an explicit index in ``device`` picks which one), the comm layer of the
    implementation staging tensors through host memory.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    dev = torch.device(device)
    if dev.type != "cuda":
        return "gloo", [str(dev)] * world_size
    n_gpus = torch.cuda.device_count()
    if n_gpus == 0:
        raise ValueError(f"device={device!r} but no CUDA device is visible")
    if n_gpus >= world_size:
        return "nccl", [f"cuda:{i}" for i in range(world_size)]
    return "gloo", [f"cuda:{dev.index or 0}"] * world_size


def rank_device() -> torch.device:
    """Inside a rank: the device this rank should put its tensors on (raises outside a rank)."""
    return _rank_worker.current_device()


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    device: str = "cpu",
    timeout: float = 120.0,
    start_method: str | None = None,
) -> list[Any]:
    """Start a fresh group, run ``fn(*args)`` on every rank, return the results in rank order, end the group.

    ``fn`` must be a picklable module-level function and its results picklable (they come
    back through a pipe; return CPU tensors). ``timeout`` bounds the call of ``fn``; the
    start of the group is bounded by ``max(timeout, 60 s)``; ``start_method`` as for
    :class:`RankPool`. Raises :class:`RankFailure`. Under a job see :class:`RankPool`.
    """
    with RankPool(world_size, device, timeout, start_method=start_method) as pool:
        return pool.run(fn, *args)


class RankPool:
    """A persistent group of ``world_size`` ranks that runs many calls without re-spawning.

    Each rank loops receiving ``(fn, args)`` and sending back the result, so a small call
    costs milliseconds. After any failure (:class:`RankFailure`) the group is torn down and
    the next :meth:`run` starts a fresh group transparently. Calls are serialised.
    ``start_method`` ("forkserver": forked from the preloaded server, or "spawn"; default
    ``$PARITY_START_METHOD``, else :func:`harness.ranks.starting.start_method`'s) is how ranks start.

    Under a job (torchrun, srun), on rank 0 inside :func:`harness.ranks.run_as_job`, the group is
    job ranks ``0..world_size-1``, each running one rank process, with the same guarantees; a
    ``world_size`` larger than the job's is a ValueError saying so.
    """

    def __init__(
        self, world_size: int, device: str = "cpu", timeout: float = 120.0, *, start_method: str | None = None
    ) -> None:
        choose_backend(device, world_size)  # refuse a bad world size or device before starting anything
        self._session = active_session()
        job = current_job() if self._session is None else self._session.job
        if job is not None and self._session is None:
            raise RuntimeError(
                f"rank pools of {job.describe()} are rank 0's, inside harness.ranks.run_as_job "
                "(the parity command runs there); every other rank serves them"
            )
        reason = job.capacity_reason(world_size) if job is not None else None
        if reason:
            raise ValueError(f"world_size={world_size}: {reason}")
        self.start_method = starting.start_method(device, start_method)
        self.world_size = world_size
        self.device = device
        self.timeout = timeout
        self._lock = threading.Lock()
        self._closed = False
        self._group: Group | JobGroup | None = self._start(timeout)

    @property
    def pids(self) -> list[int]:
        """Process ids of the live group's ranks (empty when none is running), so callers can audit them."""
        group = self._group
        return group.pids if group is not None and group.alive else []

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return one result per rank, in rank order.

        ``timeout`` (default: the pool's) bounds this call. Raises :class:`RankFailure`
        after ending every rank when one raises, dies or does not answer in time.
        """
        if self._closed:
            raise RuntimeError("RankPool.run() after close()")
        limit = self.timeout if timeout is None else timeout
        with self._lock:
            if self._group is None:
                self._group = self._start(limit)
            try:
                return self._group.call(fn, args, limit)
            finally:
                if not self._group.alive:
                    self._group = None

    def close(self) -> None:
        """End the group cleanly (each rank destroys its process group and exits) and join every rank."""
        with self._lock:
            self._closed = True
            if self._group is not None:
                self._group.close()
                self._group = None

    def terminate(self) -> None:
        """End the group now without asking the ranks (an interrupted run); no call may be running."""
        self._closed = True
        group = self._group
        if group is not None:
            group.terminate()

    def _start(self, timeout: float) -> Group | JobGroup:
        startup = max(timeout, _MIN_STARTUP_TIMEOUT_S)
        if self._session is not None:
            # One device per local rank of this node; the job's nodes are alike (each job rank takes its own).
            backend, devices = choose_backend(self.device, self._session.job.local_world_size)
            return JobGroup(self._session, backend, devices, self.world_size, startup, self.start_method)
        backend, devices = choose_backend(self.device, self.world_size)
        return Group(backend, dict(enumerate(devices)), startup, self.start_method)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:  # e.g. interrupted: the ranks' state does not matter, the time does
            self.terminate()
