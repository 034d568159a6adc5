"""One live rank group seen from the parent: its processes, their pipes, the rendezvous, and its end.

A group ends exactly once on every path (failure, timeout, close, interrupt, garbage collection,
interpreter exit) and leaves nothing: every rank's descendants killed, then every rank's process
group, every rank reaped, every pipe closed; a group still starting in the background starts no
further rank. The rendezvous is a TCPStore served here on a port the kernel picks, so groups never
collide and no file outlives a killed parent. Under a job (:mod:`harness.ranks.hosting`) each job
rank starts its own rank, meeting the others in the job's store under the group's prefix. A failure
names the rank that raised (its traceback), the rank that died (its signal), or on a timeout every
pending rank's Python stack (faulthandler on ``SIGUSR1``), so a hang says where it hangs.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist

from harness.processes import kill_descendants
from harness.ranks import starting
from harness.ranks import worker as _rank_worker
from harness.ranks.job import rank_environment
from harness.ranks.worker import ERR, LOCALHOST, STACK_SIGNAL, STOP

# After the first failure, keep listening this long so that a rank killed by a signal is
# blamed rather than its peer whose collective broke because of it.
_FAILURE_GRACE_S = 0.5
_TERMINATE_GRACE_S = 1.0
_CLOSE_TIMEOUT_S = 10.0
_REAP_TIMEOUT_S = 5.0
_STACK_WAIT_S = 3.0  # how long a timeout waits for the pending ranks' stacks
_STACK_QUIET_S = 0.2  # a dump is complete once its pipe stays quiet this long
_INTERRUPT_POLL_S = 0.05  # how often a job rank's part of a group asks whether another part failed


class FailureKind(str, Enum):
    RAISED = "raised"
    DIED = "died"
    TIMEOUT = "timeout"
    ENDED = "ended"  # this part of a group was ended because another job rank's part failed


class RankFailure(RuntimeError):
    """A rank raised, died or did not answer in time; the whole group has already been ended.

    ``rank`` is the rank to blame (None when several ranks timed out together) and ``traceback``
    its traceback, how it died, or the pending ranks' stacks. The first line of the message says
    what happened in one line (a result's reason); the rest is the evidence, so a CI log shows the
    cause without re-running. ``kind`` says which of those it is (how the failures of several
    job ranks combine into one).
    """

    def __init__(
        self, message: str, rank: int | None = None, traceback: str = "", kind: FailureKind = FailureKind.RAISED
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.kind = kind

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle through their args by default, which would drop rank and traceback.
        return (type(self), (str(self), self.rank, self.traceback, self.kind))


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's ranks meet: a store's address, the prefix of the group's keys in it, the group's size."""

    host: str
    port: int
    prefix: str
    world_size: int


class Group:
    """Ranks of one group, started by ``method`` (:mod:`harness.ranks.starting`), joined and ready.

    ``devices`` maps each rank this process starts to its device. Without ``rendezvous`` they are the
    whole group and meet in a store this process serves; with it, they are this job rank's part of a
    larger group, and ``interrupt()`` (polled while they start) says when another part failed.
    """

    # long: a rank's start and its record happen under one lock with the finalizer; split, they could interleave
    def __init__(
        self,
        backend: str,
        devices: Mapping[int, str],
        startup_timeout: float,
        method: str,
        *,
        rendezvous: Rendezvous | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> None:
        store = None
        if rendezvous is None:
            store = dist.TCPStore(
                LOCALHOST,
                0,
                len(devices),
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=startup_timeout),
            )
            rendezvous = Rendezvous(LOCALHOST, store.port, "", len(devices))
        self._ranks = sorted(devices)
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._stacks: list[Connection] = []  # raw text: faulthandler's dumps
        pipes: list[Connection] = []
        starting_lock = threading.Lock()  # a rank is started, and recorded, or the group is ended: never both at once
        # Also runs at interpreter exit or garbage collection, so a forgotten pool leaves no process.
        self._finalizer = weakref.finalize(self, _end_group, self._procs, pipes, [store], starting_lock)
        ctx = starting.context(method)
        environ = rank_environment(os.environ)
        meeting = (rendezvous.host, rendezvous.port, rendezvous.prefix)
        try:
            for rank in self._ranks:
                parent_conn, child_conn = ctx.Pipe()
                stack_r, stack_w = ctx.Pipe(duplex=False)
                pipes += (parent_conn, stack_r)
                proc = ctx.Process(
                    target=_rank_worker.worker_main,
                    args=(
                        rank,
                        rendezvous.world_size,
                        backend,
                        devices[rank],
                        meeting,
                        startup_timeout,
                        child_conn,
                        stack_w,
                        environ,
                    ),
                    name=f"parity-rank-{rank}",
                    daemon=True,
                )
                with starting_lock:
                    if not self._finalizer.alive:
                        raise RankFailure("the group was ended while it started", None, "", FailureKind.ENDED)
                    starting.start(proc, method)
                    self._procs.append(proc)
                self._conns.append(parent_conn)
                self._stacks.append(stack_r)
                child_conn.close()  # so that a dead rank reads as EOF here
                stack_w.close()
            self._gather(startup_timeout, "group start", interrupt)
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
        """``fn(*args)`` on every rank; the results in rank order, or RankFailure with the group ended."""
        # Pickled once, here: an unpicklable fn fails in the caller without touching the group.
        return self.send(pickle_call(fn, args), timeout, call_name(fn))

    def send(self, payload: bytes, timeout: float, what: str, interrupt: Callable[[], bool] | None = None) -> list[Any]:
        """A call pickled by :func:`pickle_call` on every rank this process started; as :meth:`call`, and
        ended early (RankFailure of kind ``ENDED``) once ``interrupt()`` says another part of the group failed."""
        try:
            for conn in self._conns:
                try:
                    conn.send_bytes(payload)
                except OSError:  # that rank is dead; _gather reports how it died
                    pass
            return self._gather(timeout, what, interrupt)
        except BaseException:
            self._finalizer()  # e.g. KeyboardInterrupt while waiting: never leave ranks behind
            raise

    def close(self) -> None:
        """Ask every rank to destroy its process group and exit; then end the group (leftovers killed)."""
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

    def terminate(self) -> None:
        """End the group now, without asking the ranks."""
        self._finalizer()

    def _gather(self, timeout: float, what: str, interrupt: Callable[[], bool] | None = None) -> list[Any]:
        """Wait for one answer per rank; on a failure, the timeout or an interrupt end the group and raise.

        Positions (``i``) index this process's ranks; messages name their ranks (``self._ranks[i]``)."""
        n = len(self._procs)
        index_of: dict[object, int] = {conn: i for i, conn in enumerate(self._conns)}
        index_of.update({proc.sentinel: i for i, proc in enumerate(self._procs)})
        results: dict[int, Any] = {}
        failures: list[tuple[int, bool, str]] = []  # (rank, died, text) in order of arrival
        failed: set[int] = set()
        deadline = time.monotonic() + timeout
        listen_until = deadline
        while True:
            pending = [i for i in range(n) if i not in results and i not in failed]
            remaining = listen_until - time.monotonic()
            if not pending or remaining <= 0:
                break
            if interrupt is not None:
                if interrupt():
                    self._finalizer()
                    raise RankFailure(f"ended in {what}: another rank of the group failed", None, "", FailureKind.ENDED)
                remaining = min(remaining, _INTERRUPT_POLL_S)
            ready = wait([self._conns[i] for i in pending] + [self._procs[i].sentinel for i in pending], remaining)
            for i in sorted({index_of[obj] for obj in ready}):
                answer = self._read(i)
                if answer is not None and answer[0] != ERR:
                    results[i] = answer[1]
                    continue
                failed.add(i)
                if answer is None:
                    failures.append((self._ranks[i], True, self._death(i, what)))
                else:
                    failures.append((self._ranks[i], False, answer[1]))
            if failures:
                listen_until = min(deadline, listen_until, time.monotonic() + _FAILURE_GRACE_S)
        if failures or len(results) < n:
            error = describe_failure(failures, what) if failures else self._timeout(pending, timeout, what)
            self._finalizer()
            raise error
        return [results[i] for i in range(n)]

    def _read(self, i: int) -> tuple[str, Any] | None:
        """The answer of rank ``i`` here, or None when it died without one (an answer sent just before dying counts)."""
        conn = self._conns[i]
        try:
            if not conn.poll():
                return None
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return None
        try:
            return pickle.loads(message)
        except Exception:  # e.g. a result whose class only the rank can import
            return ERR, f"the answer of rank {self._ranks[i]} could not be unpickled here:\n{traceback.format_exc()}"

    def _death(self, i: int, what: str) -> str:
        proc, rank = self._procs[i], self._ranks[i]
        proc.join(_REAP_TIMEOUT_S)
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "?"
            text = f"rank {rank} (pid {proc.pid}) was killed by signal {name} ({-code}) in {what}"
        else:
            text = f"rank {rank} (pid {proc.pid}) exited with code {code} without answering in {what}"
        crash = _read_available(self._stacks[i])  # faulthandler's dump of a fatal error, if any
        return f"{text}\n{crash}" if crash else text

    def _timeout(self, pending: list[int], timeout: float, what: str) -> RankFailure:
        """The timeout error, with the Python stack of every rank that had not answered."""
        stacks = self._pending_stacks(pending)
        return timed_out(
            {
                self._ranks[i]: f"--- rank {self._ranks[i]} (pid {self._procs[i].pid}) stack:\n"
                f"{stacks[i] or '(no stack came back)'}"
                for i in pending
            },
            timeout,
            what,
        )

    def _pending_stacks(self, pending: list[int]) -> dict[int, str]:
        """Ask each pending rank for its stacks (faulthandler answers from its C signal handler, GIL or not)."""
        for r in pending:
            _read_available(self._stacks[r])  # drop anything older than this request
            pid = self._procs[r].pid
            try:
                if pid is not None:
                    os.kill(pid, STACK_SIGNAL)
            except ProcessLookupError:
                pass
        texts = {r: "" for r in pending}
        listening = {self._stacks[r]: r for r in pending}
        deadline = time.monotonic() + _STACK_WAIT_S
        while listening and (remaining := deadline - time.monotonic()) > 0:
            complete = all(texts.values())  # then only wait for the dumps to go quiet
            ready = wait(list(listening), min(remaining, _STACK_QUIET_S) if complete else remaining)
            if not ready and complete:
                break
            for pipe in ready:
                chunk = _read_available(pipe)  # type: ignore[arg-type]
                if chunk:
                    texts[listening[pipe]] += chunk
                else:  # EOF: that rank is gone
                    del listening[pipe]
        return {r: text.rstrip() for r, text in texts.items()}


def _read_available(pipe: Connection) -> str:
    """Whatever raw text is in a stack pipe now, without blocking ("" when empty or closed)."""
    chunks: list[bytes] = []
    while True:
        try:
            if not pipe.poll(0):
                break
            chunk = os.read(pipe.fileno(), 65536)
        except (OSError, EOFError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def pickle_call(fn: Callable[..., Any], args: Sequence[Any]) -> bytes:
    return pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)


def call_name(fn: Callable[..., Any]) -> str:
    return f"call of {getattr(fn, '__qualname__', fn)!r}"


def describe_failure(failures: Sequence[tuple[int, bool, str]], what: str) -> RankFailure:
    """The error for ranks that raised or died: one that died is blamed first (its peers' collectives
    break because of it); then a rank's own error before a collective a peer left broken; among ranks that
    raised the same error, the lowest rank."""
    died = [f for f in failures if f[1]]
    if died:
        rank, _, text = died[0]
        head = text
    else:
        own = [f for f in failures if not _is_broken_collective(f[2])] or list(failures)
        first_line = _last_line(own[0][2])
        rank, _, text = min((f for f in own if _last_line(f[2]) == first_line), key=lambda f: f[0])
        head = f"rank {rank} raised: {first_line}\nin {what}:\n{text}"
    others = [f"rank {r}: {_last_line(t)}" for r, _, t in failures if r != rank]
    if others:
        head += "\nalso failed: " + "; ".join(others)
    return RankFailure(head, rank, text, FailureKind.DIED if died else FailureKind.RAISED)


def timed_out(stacks: Mapping[int, str], timeout: float, what: str) -> RankFailure:
    """The timeout error; ``stacks`` holds the evidence (its stack) of every rank that had not answered."""
    pending = sorted(stacks)
    head = f"timeout after {timeout:g}s in {what}: rank(s) {pending} had not answered"
    evidence = "\n".join(stacks[r] for r in pending)
    return RankFailure(f"{head}\n{evidence}", pending[0] if len(pending) == 1 else None, evidence, FailureKind.TIMEOUT)


# What a rank's collective raises when a peer left it: a consequence of another rank's failure, never blamed first.
_BROKEN_COLLECTIVE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "gloo/transport",
    "DistBackendError",
    "NCCL communicator was aborted",
    "Broken pipe",
)


def _is_broken_collective(text: str) -> bool:
    return any(marker in _last_line(text) for marker in _BROKEN_COLLECTIVE)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "error"


def _signal_rank_group(proc: BaseProcess, sig: int) -> None:
    """Signal the rank's process group (the rank and what it started); the rank alone if it has none yet."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass  # not a group leader yet (still starting), or nothing left in its group
    if proc.exitcode is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def _end_group(
    procs: list[BaseProcess], pipes: list[Connection], store: list[object | None], starting_lock: threading.Lock
) -> None:
    """Kill what every rank started, terminate, then kill, every rank's process group; reap every rank; close
    the pipes; drop the store."""
    with starting_lock:
        _end_ranks(procs)
    for pipe in pipes:
        pipe.close()
    store.clear()


def _end_ranks(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            kill_descendants(proc.pid)  # the rank is their subreaper while it lives: all of them are below it
    for proc in procs:
        _signal_rank_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        _signal_rank_group(proc, signal.SIGKILL)  # also what a rank started and left behind
        proc.join(_REAP_TIMEOUT_S)
