"""Running an entry point as a job: rank 0 runs it, every job rank hosts its ranks, all exit with rank 0's code.

``run_as_job(main)`` is what the ``parity`` command does under torchrun or srun. Rank 0 runs
``main()``: it alone parses, prints, writes ``--json``/``--junit``/``--report`` and decides, and
its rank pools are groups of the job's ranks (:class:`harness.ranks.jobgroup.JobGroup`). Every
job rank, rank 0 included (on a thread), serves rank 0's commands (:class:`harness.ranks.hosting.Host`);
the others do so until rank 0 is done, then end their process with rank 0's exit code. Outside a
job it is just ``main()``.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack

import torch.distributed as dist

from harness.errors import ConfigError
from harness.ranks.control import (
    LOST_ENV,
    START_ENV,
    Alive,
    Answer,
    Answered,
    Beat,
    Channel,
    Command,
    Event,
    Exit,
    Exited,
    Heartbeat,
    JobLost,
    first_line,
    lost_after_s,
    start_patience_s,
    store_gone,
)
from harness.ranks.hosting import Host
from harness.ranks.job import Job, current_job
from harness.ranks.worker import exit_without_teardown

_EXIT_WAIT_S = 30.0  # how long rank 0 waits for the other ranks to take its exit code before it goes
_WAKE_S = 0.5  # how often a waiting caller on rank 0 looks at the clock (liveness, deadlines)
# The event log is never quiet for long (every rank beats each second), so a wait on it that times out
# (c10d logs a warning each time) means a rank died between numbering an event and writing it.
_HOLE_S_PER_LOST_S = 1 / 3
_UNHEARD_GRACE_S = 60.0  # a rank not heard from yet may still be importing torch on a loaded node


def join_limit(lost_after: float) -> float:
    """Seconds rank 0 waits to hear from every rank at the start: twice the silence limit, at most a minute more
    than it (a rank may still be importing torch on a loaded node)."""
    return lost_after + min(_UNHEARD_GRACE_S, lost_after)


_active: JobSession | None = None


def active_session() -> JobSession | None:
    """The job session rank 0 is driving in this process, or None (no job, or not rank 0)."""
    return _active


def capacity_reason(world_size: int) -> str | None:
    """Why a case of ``world_size`` ranks cannot run here: more ranks than the job has (None outside a job)."""
    session = _active
    return session.job.capacity_reason(world_size) if session is not None else None


def run_as_job(main: Callable[[], int]) -> int:
    """``main()``; under a launcher's job, on rank 0 only, while every other rank serves until rank 0 is done.

    Under a job this does not return once the job is over: every rank ends its process with rank 0's
    code, SIGINT and SIGTERM ignored and without the interpreter's teardown (seconds with torch
    loaded). torchrun stops an agent's other processes as soon as one exits non-zero, so a rank
    still tearing down would be reported killed by SIGTERM instead of with the job's code. A rank
    other than 0 raises :class:`JobLost` when rank 0 or the store is gone.
    """
    job = current_job()
    if job is None:
        return main()
    global _active
    with ExitStack() as stack:
        try:
            session = stack.enter_context(JobSession(job, lost_after_s()))
        except JobLost as exc:  # a rank never joined, or the store never answered: the job cannot start
            _say(f"error: {exc}")
            exit_without_teardown(1)  # a store served here must not be destroyed by the interpreter's exit
        if job.rank == 0:
            _active = session
            code = 1  # main() raised: the others must not wait for a code
            try:
                code = main()
            finally:
                _active = None
                _ignore_signals()
                session.finish(code)
        else:
            # Decided either way: rank 0's code, or this rank's JobLost (exit 1); no signal may change it.
            code = session.host.serve(decided=_ignore_signals)
            try:
                session.channel.emit(Exited(job.rank))
            except dist.DistError:
                pass  # rank 0 is gone already: it waits for nobody
    exit_without_teardown(code)


def _say(line: str) -> None:
    print(f"parity: {line}", file=sys.stderr, flush=True)


def _ignore_signals() -> None:
    """The job is decided: a signal now could only change the exit code that reports it."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


class JobSession:
    """This process's part of a job: the store (served here under srun), its heartbeat, its host; on rank 0
    also the command log, and the events of the other ranks (:class:`Inbox`)."""

    def __init__(self, job: Job, lost_after: float) -> None:
        self.job = job
        self.lost_after = lost_after
        self.host = Host(job, lost_after)
        self.inbox = Inbox(job, lost_after)
        self._lock = threading.Lock()
        self._next_command = 0
        self._groups = 0
        self._host_thread: threading.Thread | None = None

    def __enter__(self) -> JobSession:
        self._server = None
        if self.job.serves_store:
            try:
                self._server = dist.TCPStore(
                    self.job.master_addr,
                    self.job.master_port,
                    self.job.world_size,
                    is_master=True,
                    wait_for_workers=False,
                )
            except dist.DistError as exc:
                raise ConfigError(
                    f"rank 0 cannot serve the job's store on port {self.job.master_port} ({first_line(exc)}); "
                    "set MASTER_PORT to a free port",
                    key="MASTER_PORT",
                ) from None
        try:
            self.channel = Channel.first(self.job, _say)
        except dist.DistError as exc:
            raise JobLost(
                f"job rank {self.job.rank}: the job's store at {self.job.master_addr}:{self.job.master_port} "
                f"did not answer within {START_ENV} {start_patience_s():g} s ({first_line(exc)}); is rank 0 running, "
                "with the same MASTER_ADDR:MASTER_PORT?"
            ) from None
        if self.job.rank == 0:
            self._heartbeat = Heartbeat(lambda: self.post(Beat()))
            threading.Thread(target=self.inbox.read, daemon=True, name="parity-job-inbox").start()
            self._host_thread = threading.Thread(target=self._serve_here, daemon=True, name="parity-job-host")
            self._host_thread.start()
            self.inbox.wait_for_joined()
        else:
            beats = Channel(self.job)
            self._heartbeat = Heartbeat(lambda: beats.emit(Alive(self.job.rank)))
        return self

    def __exit__(self, *_: object) -> None:
        self._heartbeat.stop()

    def _serve_here(self) -> None:
        """Rank 0's own ranks, hosted like every other job rank's; if that fails, the driver says why."""
        try:
            self.host.serve()
        except JobLost as exc:
            self.inbox.fail(str(exc))
        except BaseException:  # noqa: BLE001 - a bug here must end the run with its traceback, not a wait
            self.inbox.fail(f"rank 0's host of its own ranks failed:\n{traceback.format_exc()}")

    def post(self, command: Command) -> None:
        try:
            with self._lock:
                self.channel.post(self._next_command, command)
                self._next_command += 1
        except dist.DistError as exc:
            raise JobLost(store_gone(self.job, exc)) from None

    def new_group_id(self, world_size: int) -> str:
        with self._lock:
            self._groups += 1
            return f"w{world_size}.{self._groups}"

    def finish(self, code: int) -> None:
        """Tell every rank the exit code and wait (bounded) until each has taken it; then end rank 0's own ranks."""
        try:
            self.post(Exit(code))
        except JobLost:
            pass  # the store is gone: nobody is left to tell
        self.inbox.wait_for_exits(_EXIT_WAIT_S)
        if self._host_thread is not None:
            self._host_thread.join(_EXIT_WAIT_S)


class Inbox:
    """Rank 0's view of the other ranks: their answers, their liveness, their exits; read from the event log
    by one thread, waited on by any (under ``changed``)."""

    def __init__(self, job: Job, lost_after: float) -> None:
        self.job, self.lost_after = job, lost_after
        self.changed = threading.Condition()
        self._answers: dict[tuple[str, str], dict[int, tuple[int, Answer]]] = {}
        self._heard = {
            rank: time.monotonic() + join_limit(lost_after) - lost_after for rank in range(1, job.world_size)
        }
        self._joined: set[int] = set()
        self._exited: set[int] = set()
        self._gone: str | None = None
        self._done = False

    def read(self) -> None:
        """Read the event log until every other rank exited or the store went away (the inbox thread)."""
        channel, number = Channel(self.job), 1
        try:
            while not self._done:
                event = channel.event(number, self.lost_after * _HOLE_S_PER_LOST_S)
                if event is None:
                    if channel.events_emitted() > number:
                        number += 1  # its writer died between numbering and writing it: nothing will come
                    continue
                self._take(number, event)
                number += 1
        except dist.DistError as exc:
            self.fail(store_gone(self.job, exc))

    def fail(self, reason: str) -> None:
        """The run cannot go on, for ``reason``: every caller waiting here raises :class:`JobLost` with it."""
        with self.changed:
            self._gone = self._gone or reason
            self.changed.notify_all()

    def _take(self, number: int, event: Event) -> None:
        with self.changed:
            if isinstance(event, Answered):
                self._answers.setdefault((event.group, event.step), {})[event.rank] = (number, event.answer)
            elif isinstance(event, Alive):
                self._heard[event.rank] = time.monotonic()
                self._joined.add(event.rank)
            else:
                self._exited.add(event.rank)
                self._done = len(self._exited) == self.job.world_size - 1
            self.changed.notify_all()

    def answers(self, group: str, step: str) -> dict[int, tuple[int, Answer]]:
        """The answers to a step so far, by rank, each with its place in the job-wide order (hold ``changed``)."""
        return self._answers.get((group, step), {})

    def forget(self, group: str, step: str) -> None:
        with self.changed:
            self._answers.pop((group, step), None)

    def check(self) -> None:
        """Raise :class:`JobLost` when another rank fell silent or the store went away (hold ``changed``)."""
        if self._gone:
            raise JobLost(self._gone)
        now = time.monotonic()
        silent = {rank: now - heard for rank, heard in self._heard.items() if rank not in self._exited}
        if any(s > self.lost_after for s in silent.values()):
            # A node takes all its ranks: name every rank that has missed half the limit, not just the first one over.
            lost = sorted(rank for rank, s in silent.items() if s > self.lost_after / 2)
            raise JobLost(
                f"job rank(s) {', '.join(map(str, lost))} stopped answering (no heartbeat for "
                f"{', '.join(f'{silent[r]:.1f}' for r in lost)} s; the limit is {self.lost_after:g} s, "
                f"{LOST_ENV}): a node was lost or its process killed"
            )

    def wait(self) -> None:
        """Until something changes, or a little while (hold ``changed``)."""
        self.changed.wait(_WAKE_S)

    def wait_for_joined(self) -> None:
        """Until every other rank was heard from; :class:`JobLost` naming those never heard within the join limit."""
        limit = join_limit(self.lost_after)
        deadline = time.monotonic() + limit
        with self.changed:
            while len(self._joined) < self.job.world_size - 1 and time.monotonic() < deadline:  # poll: the join
                if self._gone:
                    raise JobLost(self._gone)
                self.wait()
            missing = sorted(set(range(1, self.job.world_size)) - self._joined)
        if missing:
            raise JobLost(
                f"job rank(s) {', '.join(map(str, missing))} never joined: nothing heard from them in {limit:g} s "
                f"({LOST_ENV} {self.lost_after:g} s plus start-up); start every process of the job with the same "
                f"MASTER_ADDR:MASTER_PORT ({self.job.master_addr}:{self.job.master_port})"
            )

    def wait_for_exits(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        with self.changed:
            while not self._done and self._gone is None and time.monotonic() < deadline:
                try:
                    self.check()
                except JobLost:
                    return  # a rank that is gone takes no exit code
                self.wait()
