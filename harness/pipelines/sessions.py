"""A pipeline target prepared once for one image case and run as often as a stage needs.

A :class:`Session` prepares the case's pipeline (never timed) on ``world_size`` ranks of a pool, or
here for a target that starts its own processes (``runs_in_ranks`` False: rank groups would only hold
devices it needs). Each :meth:`Session.run` is one generation, started together on every rank (a
barrier), timed by parity's clock on rank 0 (``wall_ms``) beside the target's own timings, with each
rank's peak memory: ``cuda_max_allocated`` on CUDA, ``rss_peak`` on Linux CPU (reset through
``/proc/self/clear_refs``), else ``rss_lifetime_peak`` (an upper bound), ``not_measured`` for a target
run here. The image stage and bless run a case once (:func:`generate`); the perf stage many times,
an A/B with two sessions in pools of their own (``tag``).
"""

from __future__ import annotations

import os
import resource
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.ranks import PoolSet, rank_device
from harness.targets.base import PipelineOutput, PipelineTarget, PreparedPipeline, Timings
from harness.targets.loader import load_pipeline_target
from harness.targets.spec import TargetSpec

NOT_MEASURED = "not_measured"
CAN_PIN = hasattr(os, "sched_setaffinity") and Path("/proc/self/task").is_dir()  # Linux
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


@dataclass(frozen=True)
class PipelineRun:
    """What a stage asks of a pipeline: the target, the fields of one case and its ranks."""

    target: TargetSpec
    fields: Mapping[str, Any]
    world_size: int
    instance: str = ""  # an A/B side: its own copy of a target run here (its own server)

    @property
    def pipeline(self) -> PipelineTarget:
        """The target as this process builds it (cached per instance)."""
        return load_pipeline_target(self.target, self.instance)

    def unavailable(self, device: str) -> str | None:
        """Why it cannot run on this machine (the case is then skipped with this), or None."""
        return self.pipeline.unavailable_reason(device, self.world_size)

    @property
    def in_ranks(self) -> bool:
        """Whether it runs in a rank group (False: its target starts its own processes)."""
        return self.pipeline.runs_in_ranks


@dataclass(frozen=True)
class TimedRun:
    """One generation: the target's own timings, parity's wall clock of it (rank 0) and every rank's peak memory."""

    timings: Timings
    wall_ms: float
    peak_memory_bytes: tuple[int, ...]  # one per rank; empty when not measured
    peak_memory_kind: str
    output: PipelineOutput | None = None  # kept only when asked for: a perf run needs the clock, not the pixels


# ------------------------------------------------------------------------------- in each rank

_PREPARED: dict[str, PreparedPipeline] = {}  # in a rank process: its live sessions, by session key


def _prepare_on_rank(key: str, target: TargetSpec, fields: Mapping[str, Any]) -> None:
    _PREPARED[key] = load_pipeline_target(target).prepare(fields, str(rank_device()))


def _run_on_rank(key: str, keep_output: bool, placement: int | None) -> tuple[TimedRun | None, int | None, str]:
    """Rank worker: one run (on the cores of ``placement``, when given); rank 0 returns it whole, every rank its
    peak memory."""
    import torch.distributed as dist

    device = str(rank_device())
    if placement is not None:
        _pin(rank_cores(placement, dist.get_rank(), dist.get_world_size()))
    run = _timed_run(_PREPARED[key], device, in_ranks=True, barrier=dist.barrier, keep_output=keep_output)
    peak = run.peak_memory_bytes[0] if run.peak_memory_bytes else None
    return (run if dist.get_rank() == 0 else None), peak, run.peak_memory_kind


def _close_on_rank(key: str) -> None:
    prepared = _PREPARED.pop(key, None)
    if prepared is not None:
        prepared.close()


_ALL_CORES: list[int] = []  # in a rank process: the cores it was started with, before any placement


def rank_cores(placement: int, rank: int, world: int) -> list[int]:
    """The cores rank ``rank`` runs on at ``placement``: as many as it runs intra-op threads (one by default),
    a block of them per rank, shifted by one block per placement.

    An A/B runs both sides of a pair at the same placement and moves to the next one with each pair: a
    core that is slower (a busy neighbour, a vCPU the host shares with other machines) then slows BASE and
    HEAD alike, where the scheduler, left alone, keeps each side's process on its own core for minutes.
    Measured: BASE = HEAD read HEAD ×1.56 [1.25, 1.93] on a loaded 2-core box, and ×1.19 to ×1.60 in 7 of
    10 A/Bs of a launch-bound 1-rank case on an H200 host, then ×0.88 the other way.
    """
    import torch

    if not _ALL_CORES:
        _ALL_CORES.extend(sorted(os.sched_getaffinity(0)))
    cores = _ALL_CORES
    width = max(1, min(len(cores) // world, torch.get_num_threads()))
    start = (placement + rank) * width
    return [cores[(start + i) % len(cores)] for i in range(width)]


def _pin(cores: list[int]) -> None:
    """Every thread of this process onto ``cores`` (a thread keeps the affinity it was created with)."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except OSError:
            pass  # a thread that just ended


# ------------------------------------------------------------------------------ the clock


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _timed_run(prepared: PreparedPipeline, device: str, *, in_ranks: bool, barrier: Any, keep_output: bool) -> TimedRun:
    kind = _reset_peak_memory(device) if in_ranks else NOT_MEASURED
    barrier()
    start = time.perf_counter()
    output = prepared.run()
    _synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1e3
    peak = (_peak_memory_bytes(device, kind),) if in_ranks else ()
    return TimedRun(output.timings, wall_ms, peak, kind, output if keep_output else None)


def _reset_peak_memory(device: str) -> str:
    """Start a fresh peak; returns the kind of peak that :func:`_peak_memory_bytes` will read."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda_max_allocated"
    try:
        _CLEAR_REFS.write_text("5")  # Linux: "5" resets the peak RSS (VmHWM) to the current RSS
        return "rss_peak"
    except OSError:
        return "rss_lifetime_peak"


def _peak_memory_bytes(device: str, kind: str) -> int:
    if kind == "cuda_max_allocated":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    if kind == "rss_peak":
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # bytes on macOS, kB on Linux


# ------------------------------------------------------------------------------ the parent


class Session:
    """``run`` prepared on ``run.world_size`` ranks of ``pools`` (pools tagged ``tag``), or here."""

    def __init__(self, run: PipelineRun, pools: PoolSet, *, tag: str = "", timeout: float | None = None) -> None:
        self.spec, self.device, self.timeout = run, pools.device, timeout
        self._key = uuid.uuid4().hex
        self._here: PreparedPipeline | None = None
        self._pool = None
        if run.in_ranks:
            self._pool = pools.get(run.world_size, tag)
            self._pool.run(_prepare_on_rank, self._key, run.target, dict(run.fields), timeout=timeout)
        else:
            self._here = run.pipeline.prepare(run.fields, pools.device, run.world_size)

    def run(self, keep_output: bool = False, placement: int | None = None) -> TimedRun:
        """One generation, timed (module docstring); ``keep_output`` brings rank 0's pixels back too; ``placement``
        puts the ranks on the cores :func:`rank_cores` gives (where the platform can pin; a target run here,
        whose processes are its own, is never pinned)."""
        if self._pool is None:
            assert self._here is not None
            return _timed_run(self._here, self.device, in_ranks=False, barrier=lambda: None, keep_output=keep_output)
        answers = self._pool.run(
            _run_on_rank, self._key, keep_output, placement if CAN_PIN else None, timeout=self.timeout
        )
        first = answers[0][0]
        if first is None:
            raise RuntimeError(f"rank 0 returned no run of {self.spec.target.name}")
        peaks = tuple(peak for _, peak, _ in answers if peak is not None)
        return TimedRun(first.timings, first.wall_ms, peaks, first.peak_memory_kind, first.output)

    def close(self) -> None:
        """Release the prepared pipeline (a pool that failed has already ended its ranks, and with them it)."""
        if self._here is not None:
            here, self._here = self._here, None
            here.close()
        elif self._pool is not None:
            pool, self._pool = self._pool, None
            if pool.pids:
                pool.run(_close_on_rank, self._key, timeout=self.timeout)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def generate(run: PipelineRun, pools: PoolSet, timeout: float | None = None) -> PipelineOutput:
    """One generation of ``run`` (prepare, run, close) and rank 0's output.

    One rank runs in a 1-rank pool too, so every case (and its reference) runs in the same process
    setup (a rank's thread count, its device) and only the SP degree differs.
    """
    with Session(run, pools, timeout=timeout) as session:
        output = session.run(keep_output=True).output
    assert output is not None
    return output
