"""What the ranks of a job say to each other, through the job's store (the one at ``MASTER_ADDR:MASTER_PORT``).

Two logs, each read in order with a blocking wait (no polling). Commands, rank 0 to every job rank
(``cmd/<rank>``): start a group, call it, abort a step, stop it, exit, and a :class:`Beat` every
second, so a job rank that hears nothing for ``PARITY_JOB_LOST_S`` seconds knows rank 0 is gone.
Events, every other job rank to rank 0 (``event/<rank>``): its answer to a step, :class:`Alive` every
second (a rank silent that long is lost), :class:`Exited` once it took rank 0's exit code. An
event's number is its place in one job-wide order, which tells the rank that failed first from
those whose collectives broke because of it. A store connection serves one request at a time, so
each talking thread has its own :class:`Channel`.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from harness.errors import ConfigError
from harness.ranks.group import RankFailure
from harness.ranks.job import Job

LOST_ENV = "PARITY_JOB_LOST_S"
DEFAULT_LOST_S = 30.0
BEAT_S = 1.0
START_ENV = "PARITY_JOB_START_S"
DEFAULT_START_S = 300.0  # the job's processes start within this of each other (a node may pull an image first)
_CONNECT_TIMEOUT_S = 60.0  # a later connection to a store that answered already
_ATTEMPT_S = 5.0  # one connection attempt (torch's client takes up to about twice its timeout)


class JobLost(RuntimeError):
    """A job rank stopped answering (its node lost, its process killed) or the job's store went away:
    the run cannot go on, every surviving rank ends with this message and a non-zero exit."""


@dataclass(frozen=True)
class Start:
    """Job ranks ``0..world_size-1`` each start their rank of ``group``; ``devices[local_rank]`` is its device,
    ``preload`` what rank 0's preloaded server imports (so every job rank's server imports the same)."""

    group: str
    world_size: int
    backend: str
    devices: tuple[str, ...]
    startup_timeout: float
    start_method: str
    preload: tuple[str, ...]


@dataclass(frozen=True)
class Call:
    """A call pickled by :func:`harness.ranks.group.pickle_call`, for every rank of ``group``."""

    group: str
    step: str
    payload: bytes
    timeout: float
    what: str


@dataclass(frozen=True)
class Abort:
    """Another job rank's part of this step failed: end this rank's part now, do not wait in its collective."""

    group: str
    step: str


@dataclass(frozen=True)
class Stop:
    """End the ranks of ``group``: ask them to exit, or with ``now`` end them without asking."""

    group: str
    now: bool


@dataclass(frozen=True)
class Beat:
    """Rank 0 is alive (every second)."""


@dataclass(frozen=True)
class Exit:
    """Rank 0 is done: every job rank ends its groups and exits with ``code``."""

    code: int


Command = Start | Call | Abort | Stop | Beat | Exit


@dataclass(frozen=True)
class Answer:
    """One job rank's answer to a step: its rank's value, or its failure."""

    value: Any = None
    failure: RankFailure | None = None


@dataclass(frozen=True)
class Answered:
    group: str
    step: str
    rank: int
    answer: Answer


@dataclass(frozen=True)
class Alive:
    rank: int


@dataclass(frozen=True)
class Exited:
    rank: int


Event = Answered | Alive | Exited


def first_line(exc: BaseException) -> str:
    """An exception in one line (c10d's carry a C++ stack after it)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def store_gone(job: Job, exc: BaseException) -> str:
    return (
        f"the job's store at {job.master_addr}:{job.master_port} went away ({first_line(exc)}): "
        "rank 0's node was lost or the job ended"
    )


def start_patience_s() -> float:
    """``PARITY_JOB_START_S``: how long a process waits for the job's store at its start (default 300)."""
    text = os.environ.get(START_ENV, "").strip()
    try:
        value = float(text) if text else DEFAULT_START_S
    except ValueError:
        raise ConfigError(f"not a number of seconds: {text!r}", key=START_ENV) from None
    if not 0 < value < float("inf"):
        raise ConfigError(f"must be a finite number of seconds > 0, got {text!r}", key=START_ENV)
    return value


def lost_after_s() -> float:
    """``PARITY_JOB_LOST_S``: how long a rank may stay silent before it counts as lost (checked before any work)."""
    text = os.environ.get(LOST_ENV, "").strip()
    if not text:
        return DEFAULT_LOST_S
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"not a number of seconds: {text!r}", key=LOST_ENV) from None
    if not 2 * BEAT_S < value < float("inf"):
        raise ConfigError(f"must be a finite number of seconds > {2 * BEAT_S:g}, got {text!r}", key=LOST_ENV)
    return value


class Channel:
    """One connection to the job's store, every key under the job's prefix."""

    def __init__(self, job: Job, timeout: float = _CONNECT_TIMEOUT_S) -> None:
        raw = dist.TCPStore(job.master_addr, job.master_port, is_master=False, timeout=timedelta(seconds=timeout))
        self._store = dist.PrefixStore(job.prefix, raw)

    @classmethod
    def first(cls, job: Job, say: Callable[[str], None]) -> Channel:
        """A process's first connection: attempts for ``PARITY_JOB_START_S`` seconds, saying once that it
        waits (a rank started before rank 0, or without it, was silent for ten minutes)."""
        patience = start_patience_s()
        deadline, told = time.monotonic() + patience, False
        while True:  # poll: a connection attempt, until the deadline
            try:
                return cls(job, _ATTEMPT_S)
            except dist.DistError:
                if time.monotonic() >= deadline:
                    raise
                if not told:
                    say(
                        f"job rank {job.rank}: waiting for the job's store at {job.master_addr}:{job.master_port} "
                        f"(up to {patience:g} s; rank 0 or the launcher serves it)"
                    )
                    told = True

    def post(self, index: int, command: Command) -> None:
        self._store.set(f"cmd/{index}", _dumps(command))

    def command(self, index: int, timeout: float) -> Command | None:
        """Command ``index`` once it is posted; None after ``timeout`` seconds without it."""
        return self._take(f"cmd/{index}", timeout, keep=True)

    def emit(self, event: Event) -> None:
        number = self._store.add("events", 1)
        self._store.set(f"event/{number}", _dumps(event))

    def event(self, number: int, timeout: float) -> Event | None:
        """Event ``number`` (from 1) once it is emitted, read once (rank 0 alone reads events); None after ``timeout``."""
        return self._take(f"event/{number}", timeout, keep=False)

    def events_emitted(self) -> int:
        return self._store.add("events", 0)

    def _take(self, key: str, timeout: float, keep: bool) -> Any:
        try:
            self._store.wait([key], timedelta(seconds=timeout))
        except dist.DistStoreError:  # the wait timed out (a store that went away raises DistNetworkError)
            return None
        value = pickle.loads(self._store.get(key))
        if not keep:
            self._store.delete_key(key)
        return value


class Heartbeat:
    """``send()`` every :data:`BEAT_S` on its own thread, until stopped or the store is gone."""

    def __init__(self, send: Callable[[], None]) -> None:
        self._send = send
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="parity-job-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._send()
            except (dist.DistError, JobLost):
                return  # the store is gone: whoever waits on it says so
            self._stop.wait(BEAT_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
