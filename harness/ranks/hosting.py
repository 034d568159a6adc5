"""Every job rank's part of the job: it hosts its own rank of each group rank 0 starts.

A :class:`Host` reads rank 0's command log in order. A group's commands run in order on the
group's own thread (groups start in the background, several at once), where a local
:class:`~harness.ranks.group.Group` of one rank (this job rank's) does the work: the rank process,
its pipes, its timeout with the stack of a rank that hangs, its end. Its answer goes to rank 0 as
an event; while it waits, an :class:`~harness.ranks.control.Abort` (another job rank's part of the
step failed) ends it at once, as a local group ends every rank when one fails.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable

import torch.distributed as dist

from harness.ranks.control import (
    Abort,
    Answer,
    Answered,
    Beat,
    Call,
    Channel,
    Command,
    Exit,
    JobLost,
    Start,
    Stop,
    first_line,
    store_gone,
)
from harness.ranks.group import FailureKind, Group, RankFailure, Rendezvous
from harness.ranks.job import Job
from harness.ranks.starting import preload

_JOIN_S = 15.0  # how long ending a job rank waits for each group's thread


class Host:
    """This job rank's ranks of every group, driven by rank 0's commands."""

    def __init__(self, job: Job, lost_after: float) -> None:
        self.job = job
        self.lost_after = lost_after
        self._groups: dict[str, _HostedGroup] = {}
        self._stopped: list[_HostedGroup] = []  # joined at the end, so a closing group does not hold up the log

    def serve(self, decided: Callable[[], None] = lambda: None) -> int:
        """Run rank 0's commands until it says exit; its exit code.

        Raises :class:`JobLost` when rank 0 falls silent or the job's store goes away. Every rank
        this job rank started is ended on the way out, whatever the way, after ``decided()``.
        """
        now = True
        try:
            channel, index = Channel(self.job), 0
            while True:
                command = channel.command(index, self.lost_after)
                if command is None:
                    raise JobLost(
                        f"job rank {self.job.rank}: rank 0 stopped answering (not a word for "
                        f"{self.lost_after:g} s): its node was lost or its process killed"
                    )
                index += 1
                if isinstance(command, Exit):
                    now = False
                    return command.code
                self._dispatch(command)
        except dist.DistError as exc:
            raise JobLost(f"job rank {self.job.rank}: {store_gone(self.job, exc)}") from None
        finally:
            decided()
            self._end_all(now)

    def _dispatch(self, command: Command) -> None:
        if isinstance(command, Beat):
            return
        if isinstance(command, Start):
            if self.job.rank < command.world_size:
                self._groups[command.group] = _HostedGroup(self.job, command)
            return
        assert isinstance(command, Call | Abort | Stop)
        hosted = self._groups.get(command.group)
        if hosted is None:
            return  # a group this job rank has no rank in
        if isinstance(command, Abort):
            hosted.aborted.add(command.step)  # read by the group's thread while it waits: not queued behind it
            return
        hosted.commands.put(command)
        if isinstance(command, Stop):
            if command.now:
                hosted.end_now()  # its thread may be waiting on a call that will never answer
            self._stopped.append(self._groups.pop(command.group))

    def _end_all(self, now: bool) -> None:
        for hosted in self._groups.values():
            hosted.commands.put(Stop(hosted.group_id, now))
            if now:
                hosted.end_now()
        for hosted in [*self._groups.values(), *self._stopped]:
            hosted.thread.join(_JOIN_S)
        self._groups.clear()
        self._stopped.clear()


class _HostedGroup:
    """This job rank's rank of one group, on its own thread and store connection."""

    def __init__(self, job: Job, start: Start) -> None:
        self.job, self.group_id = job, start.group
        self.commands: queue.Queue[Call | Stop] = queue.Queue()
        self.aborted: set[str] = set()
        self._ending = threading.Event()
        self._group: Group | None = None
        self.thread = threading.Thread(target=self._run, args=(start,), daemon=True, name=f"parity-host-{start.group}")
        self.thread.start()

    def end_now(self) -> None:
        """End this rank now, whatever its thread waits for (a start or a call that will never finish)."""
        self._ending.set()
        group = self._group
        if group is not None:
            group.terminate()

    def _interrupted(self, step: str) -> bool:
        return self._ending.is_set() or step in self.aborted

    def _run(self, start: Start) -> None:
        try:
            channel = Channel(self.job)
            self._start(channel, start)
            while True:
                command = self.commands.get()
                if isinstance(command, Stop):
                    if self._group is not None and not command.now:
                        self._group.close()
                    break
                self._call(channel, command)
        except dist.DistError:
            pass  # the store is gone: the serving loop says so
        finally:
            group, self._group = self._group, None
            if group is not None:
                group.terminate()  # nothing left after close(); after anything else, the rank ends here

    def _answer(self, channel: Channel, step: str, answer: Answer) -> None:
        channel.emit(Answered(self.group_id, step, self.job.rank, answer))

    def _start(self, channel: Channel, start: Start) -> None:
        rank = self.job.rank
        try:
            if self.job.local_rank >= len(start.devices):
                raise RuntimeError(
                    f"job rank {rank} is local rank {self.job.local_rank} of its node, but rank 0's node "
                    f"has {len(start.devices)} (the job's nodes must run as many ranks each)"
                )
            preload(start.preload)
            meeting = Rendezvous(
                self.job.master_addr, self.job.master_port, f"{self.job.prefix}{start.group}/pg/", start.world_size
            )
            self._group = Group(
                start.backend,
                {rank: start.devices[self.job.local_rank]},
                start.startup_timeout,
                start.start_method,
                rendezvous=meeting,
                interrupt=lambda: self._interrupted("start"),
            )
        except RankFailure as failure:
            self._answer(channel, "start", Answer(failure=failure))
            return
        except Exception as exc:  # noqa: BLE001 - anything that stops this rank from starting is its failure
            self._answer(channel, "start", _broken(rank, "start its rank of the group", exc))
            return
        self._answer(channel, "start", Answer())

    def _call(self, channel: Channel, call: Call) -> None:
        if self._group is None or not self._group.alive:
            ended = RankFailure(
                f"rank {self.job.rank} has no live rank process for {call.what}", self.job.rank, "", FailureKind.ENDED
            )
            self._answer(channel, call.step, Answer(failure=ended))
            return
        try:
            (value,) = self._group.send(
                call.payload, call.timeout, call.what, interrupt=lambda: self._interrupted(call.step)
            )
        except RankFailure as failure:
            self._answer(channel, call.step, Answer(failure=failure))
            return
        except Exception as exc:  # noqa: BLE001 - answered, so rank 0 reports it instead of waiting for the timeout
            self._answer(channel, call.step, _broken(self.job.rank, f"run {call.what}", exc))
            return
        self._answer(channel, call.step, Answer(value))


def _broken(rank: int, doing: str, exc: Exception) -> Answer:
    """A failure of this job rank itself (not of its rank process), with the traceback, as its answer."""
    return Answer(
        failure=RankFailure(f"job rank {rank} could not {doing}: {first_line(exc)}", rank, traceback.format_exc())
    )
