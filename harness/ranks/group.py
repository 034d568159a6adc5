"""One live rank group seen from the parent: its processes, their pipes, the rendezvous, and its end.

A group ends exactly once, on every path (a failure, a timeout, close, an interrupt, garbage
collection, interpreter exit), and ending it leaves nothing: every rank's process group is
killed (the rank and whatever it started), every rank reaped, every pipe closed. The rendezvous
is a TCPStore served by this process on a port the kernel picks, so concurrent groups cannot
collide and no file outlives a parent that was killed.

What a failure says: the rank that raised, with its traceback, or the rank that died and by which
signal, or, on a timeout, the Python stack of every rank that had not answered (faulthandler, on
``SIGUSR1``), so a hang says where it hangs.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist

from harness.ranks import starting
from harness.ranks import worker as _rank_worker
from harness.ranks.worker import ERR, LOCALHOST, STACK_SIGNAL, STOP

# After the first failure, keep listening this long so that a rank killed by a signal is
# blamed rather than its peer whose collective broke because of it.
_FAILURE_GRACE_S = 0.5
_TERMINATE_GRACE_S = 1.0
_CLOSE_TIMEOUT_S = 10.0
_REAP_TIMEOUT_S = 5.0
_STACK_WAIT_S = 3.0  # how long a timeout waits for the pending ranks' stacks
_STACK_QUIET_S = 0.2  # a dump is complete once its pipe stays quiet this long


class RankFailure(RuntimeError):
    """A rank raised, died or did not answer in time; the whole group has already been ended.

    ``rank`` is the rank to blame (None when several ranks timed out together) and ``traceback``
    its traceback, how it died, or the pending ranks' stacks. The first line of the message says
    what happened in one line (a result's reason); the rest is the evidence, so a CI log shows the
    cause without re-running.
    """

    def __init__(self, message: str, rank: int | None = None, traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle through their args by default, which would drop rank and traceback.
        return (type(self), (str(self), self.rank, self.traceback))


class Group:
    """The ranks of one group, started by ``method`` (:mod:`harness.ranks.starting`), joined and ready."""

    def __init__(self, backend: str, devices: Sequence[str], startup_timeout: float, method: str) -> None:
        world_size = len(devices)
        store = dist.TCPStore(LOCALHOST, 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=startup_timeout))
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._stacks: list[Connection] = []  # raw text: faulthandler's dumps
        pipes: list[Connection] = []
        # Also runs at interpreter exit or garbage collection, so a forgotten pool leaves no process.
        self._finalizer = weakref.finalize(self, _end_group, self._procs, pipes, [store])
        ctx = starting.context(method)
        environ = dict(os.environ)
        try:
            for rank in range(world_size):
                parent_conn, child_conn = ctx.Pipe()
                stack_r, stack_w = ctx.Pipe(duplex=False)
                pipes += (parent_conn, stack_r)
                proc = ctx.Process(
                    target=_rank_worker.worker_main,
                    args=(rank, world_size, backend, devices[rank], store.port, startup_timeout, child_conn, stack_w, environ),
                    name=f"parity-rank-{rank}",
                    daemon=True,
                )
                starting.start(proc, method)
                self._procs.append(proc)
                self._conns.append(parent_conn)
                self._stacks.append(stack_r)
                child_conn.close()  # so that a dead rank reads as EOF here
                stack_w.close()
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
        """``fn(*args)`` on every rank; the results in rank order, or RankFailure with the group ended."""
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
            error = describe_failure(failures, what) if failures else self._timeout(pending, timeout, what)
            self._finalizer()
            raise error
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
            text = f"rank {rank} (pid {proc.pid}) was killed by signal {name} ({-code}) in {what}"
        else:
            text = f"rank {rank} (pid {proc.pid}) exited with code {code} without answering in {what}"
        crash = _read_available(self._stacks[rank])  # faulthandler's dump of a fatal error, if any
        return f"{text}\n{crash}" if crash else text

    def _timeout(self, pending: list[int], timeout: float, what: str) -> RankFailure:
        """The timeout error, with the Python stack of every rank that had not answered."""
        stacks = self._pending_stacks(pending)
        head = f"timeout after {timeout:g}s in {what}: rank(s) {pending} had not answered"
        evidence = "\n".join(f"--- rank {r} (pid {self._procs[r].pid}) stack:\n{stacks[r] or '(no stack came back)'}"
                             for r in pending)
        return RankFailure(f"{head}\n{evidence}", pending[0] if len(pending) == 1 else None, evidence)

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


def describe_failure(failures: list[tuple[int, bool, str]], what: str) -> RankFailure:
    """The error for ranks that raised or died: one that died is blamed first (its peers' collectives
    break because of it); among ranks that raised the same error, the lowest rank."""
    died = [f for f in failures if f[1]]
    if died:
        rank, _, text = died[0]
        head = text
    else:
        first_line = _last_line(failures[0][2])
        rank, _, text = min((f for f in failures if _last_line(f[2]) == first_line), key=lambda f: f[0])
        head = f"rank {rank} raised: {first_line}\nin {what}:\n{text}"
    others = [f"rank {r}: {_last_line(t)}" for r, _, t in failures if r != rank]
    if others:
        head += "\nalso failed: " + "; ".join(others)
    return RankFailure(head, rank, text)


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


def _end_group(procs: list[BaseProcess], pipes: list[Connection], store: list[object]) -> None:
    """Terminate, then kill, every rank's process group; reap every rank; close the pipes; drop the store."""
    for proc in procs:
        _signal_rank_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        _signal_rank_group(proc, signal.SIGKILL)  # also what a rank started and left behind
        proc.join(_REAP_TIMEOUT_S)
    for pipe in pipes:
        pipe.close()
    store.clear()
