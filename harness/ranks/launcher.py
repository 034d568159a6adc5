"""Run a function on N ranks of a real torch.distributed process group on one host.

Parity checks must exercise the same collectives production uses, so every rank
is a real process in a real group (gloo on CPU, NCCL with one GPU per rank).
What this module adds is robustness for a CI gate: rendezvous that cannot
collide between groups started at the same time (a FileStore on a fresh
``mkstemp`` file), a timeout per call, a failing rank's traceback in the error,
every rank ended on any failure and no child process ever left behind. A
:class:`RankPool` keeps one group alive so a small case costs milliseconds
instead of a spawn. Under torchrun (multi-node) nothing is spawned: the env://
group of the calling process is used instead.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from harness.ranks import worker as _rank_worker
from harness.ranks.worker import ERR, OK, STOP

__all__ = ["RankFailure", "RankPool", "choose_backend", "rank_device", "run_on_ranks"]

# Starting a group imports torch in every rank: seconds on a loaded 2-core CI box, so a
# short per-call timeout must not also bound the start.
_MIN_STARTUP_TIMEOUT_S = 60.0
# After the first failure, keep listening this long so that a rank killed by a signal is
# blamed rather than its peer whose collective broke because of it.
_FAILURE_GRACE_S = 0.3
_TERMINATE_GRACE_S = 1.0
_CLOSE_TIMEOUT_S = 10.0
_REAP_TIMEOUT_S = 5.0


class RankFailure(RuntimeError):
    """A rank raised, died or did not answer in time; the whole group has already been ended.

    ``rank`` is the rank to blame (None when several ranks timed out together) and
    ``traceback`` its traceback text or how it died; both are also in the message, so
    a CI log shows the cause without re-running.
    """

    def __init__(self, message: str, rank: int | None = None, traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle through their args by default, which would drop rank and traceback.
        return (type(self), (str(self), self.rank, self.traceback))


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
    fn: Callable[..., Any], *args: Any, world_size: int, device: str = "cpu", timeout: float = 120.0
) -> list[Any]:
    """Start a fresh group, run ``fn(*args)`` on every rank, return the results in rank order, end the group.

    ``fn`` must be a picklable module-level function and its results picklable (they come
    back through a pipe; return CPU tensors). ``timeout`` bounds the call of ``fn``; the
    start of the group is bounded by ``max(timeout, 60 s)``. Raises :class:`RankFailure`.
    Under torchrun see :class:`RankPool`.
    """
    if _torchrun_world_size() is not None:
        return _run_under_torchrun(fn, args, world_size, device)
    with RankPool(world_size, device, timeout) as pool:
        return pool.run(fn, *args)


class RankPool:
    """A persistent group of ``world_size`` ranks that runs many calls without re-spawning.

    Each rank loops receiving ``(fn, args)`` and sending back the result, so a small call
    costs milliseconds. After any failure (:class:`RankFailure`) the group is torn down and
    the next :meth:`run` starts a fresh group transparently. Calls are serialised.

    Under torchrun (``RANK`` and ``WORLD_SIZE`` set) nothing is spawned: :meth:`run` joins
    the env:// group once, runs ``fn`` in this process and returns every rank's result
    gathered with ``all_gather_object``, so every torchrun rank must make the same calls;
    there the per-call timeout is not enforced (the group's own timeout and torchrun's
    agent end a hung job).
    """

    def __init__(self, world_size: int, device: str = "cpu", timeout: float = 120.0) -> None:
        choose_backend(device, world_size)  # refuse a bad world size or device before spawning
        torchrun_world = _torchrun_world_size()
        if torchrun_world is not None:
            _check_torchrun_world_size(world_size, torchrun_world)
        self.world_size = world_size
        self.device = device
        self.timeout = timeout
        self._under_torchrun = torchrun_world is not None
        self._lock = threading.Lock()
        self._closed = False
        self._group: _Group | None = None
        if not self._under_torchrun:
            self._group = _Group(world_size, device, max(timeout, _MIN_STARTUP_TIMEOUT_S))

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
                self._group = _Group(self.world_size, self.device, max(limit, _MIN_STARTUP_TIMEOUT_S))
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

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Group:
    """One live group: the spawned ranks, their pipes and the rendezvous file, ended exactly once."""

    def __init__(self, world_size: int, device: str, startup_timeout: float) -> None:
        backend, devices = choose_backend(device, world_size)
        fd, store_path = tempfile.mkstemp(prefix="parity-rendezvous-")
        os.close(fd)
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        # Also runs at interpreter exit or garbage collection, so a forgotten pool leaves no process.
        self._finalizer = weakref.finalize(self, _end_group, self._procs, self._conns, store_path)
        ctx = multiprocessing.get_context("spawn")
        try:
            for rank in range(world_size):
                parent_conn, child_conn = ctx.Pipe()
                proc = ctx.Process(
                    target=_rank_worker.worker_main,
                    args=(rank, world_size, backend, devices[rank], store_path, child_conn, os.getpid()),
                    name=f"parity-rank-{rank}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()  # so that a dead rank reads as EOF here
                self._procs.append(proc)
                self._conns.append(parent_conn)
            self._gather(startup_timeout, "group start")
        except BaseException:
            self._finalizer()
            raise

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs if proc.pid is not None]

    def call(self, fn: Callable[..., Any], args: Sequence[Any], timeout: float) -> list[Any]:
        # Pickled once, here: an unpicklable fn fails in the caller without touching the group.
        payload = pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                try:
                    conn.send_bytes(payload)
                except OSError:  # that rank is dead; _gather reports how it died
                    pass
            return self._gather(timeout, f"call of {getattr(fn, '__qualname__', fn)!r}")
        except BaseException:
            self._finalizer()  # e.g. KeyboardInterrupt while waiting: never leave ranks behind
            raise

    def close(self) -> None:
        if not self.alive:
            return
        for conn in self._conns:
            try:
                conn.send_bytes(STOP)
            except OSError:
                pass
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()

    def _gather(self, timeout: float, what: str) -> list[Any]:
        """Wait for one answer per rank; on a failure or the timeout end the group and raise."""
        n = len(self._procs)
        rank_of: dict[object, int] = {conn: r for r, conn in enumerate(self._conns)}
        rank_of.update({proc.sentinel: r for r, proc in enumerate(self._procs)})
        results: dict[int, Any] = {}
        failures: list[tuple[int, bool, str]] = []  # (rank, died, text) in order of arrival
        deadline = time.monotonic() + timeout
        listen_until = deadline
        while True:
            pending = [r for r in range(n) if r not in results and all(f[0] != r for f in failures)]
            remaining = listen_until - time.monotonic()
            if not pending or remaining <= 0:
                break
            ready = wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending], remaining)
            for r in sorted({rank_of[obj] for obj in ready}):
                answer = self._read(r)
                if answer is None:
                    failures.append((r, True, self._death(r, what)))
                elif answer[0] == ERR:
                    failures.append((r, False, answer[1]))
                else:
                    results[r] = answer[1]
            if failures:
                listen_until = min(deadline, listen_until, time.monotonic() + _FAILURE_GRACE_S)
        if failures or len(results) < n:
            self._finalizer()
            raise _failure(failures, pending, timeout, what)
        return [results[r] for r in range(n)]

    def _read(self, rank: int) -> tuple[str, Any] | None:
        """The rank's answer, or None when it died without one (an answer sent just before dying counts)."""
        conn = self._conns[rank]
        try:
            if not conn.poll():
                return None
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return None
        try:
            return pickle.loads(message)
        except Exception:  # e.g. a result whose class only the rank can import
            return ERR, f"the answer of rank {rank} could not be unpickled here:\n{traceback.format_exc()}"

    def _death(self, rank: int, what: str) -> str:
        proc = self._procs[rank]
        proc.join(_REAP_TIMEOUT_S)
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "?"
            return f"rank {rank} (pid {proc.pid}) was killed by signal {name} ({-code}) in {what}"
        return f"rank {rank} (pid {proc.pid}) exited with code {code} without answering in {what}"


def _failure(failures: list[tuple[int, bool, str]], pending: list[int], timeout: float, what: str) -> RankFailure:
    """The error to raise: a rank that died is blamed before one that raised (its peers' collectives break)."""
    if not failures:
        msg = f"timeout after {timeout:g}s in {what}: rank(s) {pending} had not answered"
        return RankFailure(msg, pending[0] if len(pending) == 1 else None, msg)
    rank, died, text = sorted(failures, key=lambda f: not f[1])[0]
    head = text if died else f"rank {rank} raised in {what}:\n{text}"
    others = [f"rank {r}: {t.strip().splitlines()[-1]}" for r, _, t in failures if r != rank]
    if others:
        head += "\nalso failed: " + "; ".join(others)
    return RankFailure(head, rank, text)


def _end_group(procs: list[BaseProcess], conns: list[Connection], store_path: str) -> None:
    """Terminate, then kill, then reap every rank; close the pipes; remove the rendezvous file."""
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
        proc.join(_REAP_TIMEOUT_S)
    for conn in conns:
        conn.close()
    try:
        os.unlink(store_path)
    except FileNotFoundError:  # the ranks' FileStore removes it when the last one lets go
        pass


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
        raise _failure(failures, [], 0.0, f"call of {getattr(fn, '__qualname__', fn)!r}")
    return [payload for _, payload in everyone]
