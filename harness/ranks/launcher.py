"""Run a function on N ranks of a real torch.distributed process group on one host.

Parity checks must exercise the same collectives production uses, so every rank is a real
process in a real group (gloo on CPU, NCCL with one GPU per rank). What this package adds is
robustness for a CI gate (:mod:`harness.ranks.group`): a rendezvous that cannot collide, a
timeout per call with the stacks of the ranks that hang, a failing rank's traceback in the
error, every rank ended at once on any failure and no process ever left behind; and speed
(:mod:`harness.ranks.starting`): ranks forked from a preloaded server instead of each importing
torch. A :class:`RankPool` keeps one group alive so a small case costs milliseconds instead of a
start. Under torchrun (multi-node) nothing is started: the env:// group of the calling process
is used instead.
"""

from __future__ import annotations

import atexit
import os
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from harness.ranks import starting
from harness.ranks import worker as _rank_worker
from harness.ranks.group import Group, RankFailure, describe_failure
from harness.ranks.worker import ERR, OK

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
    fn: Callable[..., Any], *args: Any, world_size: int, device: str = "cpu", timeout: float = 120.0,
    start_method: str | None = None,
) -> list[Any]:
    """Start a fresh group, run ``fn(*args)`` on every rank, return the results in rank order, end the group.

    ``fn`` must be a picklable module-level function and its results picklable (they come
    back through a pipe; return CPU tensors). ``timeout`` bounds the call of ``fn``; the
    start of the group is bounded by ``max(timeout, 60 s)``; ``start_method`` as for
    :class:`RankPool`. Raises :class:`RankFailure`. Under torchrun see :class:`RankPool`.
    """
    if _torchrun_world_size() is not None:
        return _run_under_torchrun(fn, args, world_size, device)
    with RankPool(world_size, device, timeout, start_method=start_method) as pool:
        return pool.run(fn, *args)


class RankPool:
    """A persistent group of ``world_size`` ranks that runs many calls without re-spawning.

    Each rank loops receiving ``(fn, args)`` and sending back the result, so a small call
    costs milliseconds. After any failure (:class:`RankFailure`) the group is torn down and
    the next :meth:`run` starts a fresh group transparently. Calls are serialised.
    ``start_method`` ("forkserver": forked from the preloaded server, or "spawn"; default
    ``$PARITY_START_METHOD``, else :func:`harness.ranks.starting.start_method`'s) is how ranks start.

    Under torchrun (``RANK`` and ``WORLD_SIZE`` set) nothing is spawned: :meth:`run` joins
    the env:// group once, runs ``fn`` in this process and returns every rank's result
    gathered with ``all_gather_object``, so every torchrun rank must make the same calls;
    there the per-call timeout is not enforced (the group's own timeout and torchrun's
    agent end a hung job).
    """

    def __init__(self, world_size: int, device: str = "cpu", timeout: float = 120.0, *,
                 start_method: str | None = None) -> None:
        choose_backend(device, world_size)  # refuse a bad world size or device before starting anything
        self.start_method = starting.start_method(device, start_method)
        torchrun_world = _torchrun_world_size()
        if torchrun_world is not None:
            _check_torchrun_world_size(world_size, torchrun_world)
        self.world_size = world_size
        self.device = device
        self.timeout = timeout
        self._under_torchrun = torchrun_world is not None
        self._lock = threading.Lock()
        self._closed = False
        self._group: Group | None = None
        if not self._under_torchrun:
            self._group = self._start(timeout)

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
        if self._under_torchrun:
            return _run_under_torchrun(fn, args, self.world_size, self.device)
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

    def _start(self, timeout: float) -> Group:
        backend, devices = choose_backend(self.device, self.world_size)
        return Group(backend, devices, max(timeout, _MIN_STARTUP_TIMEOUT_S), self.start_method)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:  # e.g. interrupted: the ranks' state does not matter, the time does
            self.terminate()


def _torchrun_world_size() -> int | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _check_torchrun_world_size(world_size: int, torchrun_world: int) -> None:
    if world_size != torchrun_world:
        raise ValueError(
            f"world_size={world_size} but torchrun started WORLD_SIZE={torchrun_world} ranks; "
            "under torchrun the group is torchrun's, so pass world_size=int(os.environ['WORLD_SIZE'])"
        )


def _destroy_group_if_alive() -> None:
    """At exit, destroy the env:// group this module created (NCCL warns otherwise) unless the user did."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_under_torchrun(fn: Callable[..., Any], args: Sequence[Any], world_size: int, device: str) -> list[Any]:
    """Run ``fn`` on this torchrun rank; every rank gets every rank's result (or the same RankFailure)."""
    _check_torchrun_world_size(world_size, int(os.environ["WORLD_SIZE"]))
    if not dist.is_initialized() or not _rank_worker.has_device():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        backend, devices = choose_backend(device, local_world)
        _rank_worker.set_device(torch.device(devices[int(os.environ.get("LOCAL_RANK", 0))]))
        if not dist.is_initialized():  # a group the user initialised is used as it is
            dist.init_process_group(backend, init_method="env://")
            atexit.register(_destroy_group_if_alive)
    try:
        mine: tuple[str, Any] = (OK, fn(*args))
    except Exception:  # shared with every rank below, so all of them raise the same RankFailure
        mine = (ERR, traceback.format_exc())
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    failures = [(r, False, payload) for r, (kind, payload) in enumerate(everyone) if kind == ERR]
    if failures:
        raise describe_failure(failures, f"call of {getattr(fn, '__qualname__', fn)!r}")
    return [payload for _, payload in everyone]
