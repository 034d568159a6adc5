"""What the image and perf stages (and ``parity bless``) run in the ranks: a pipeline target's generations.

Both run an image case on ``case.world_size`` ranks of a live pool through the pipeline target
(:class:`~harness.targets.base.PipelineTarget`), each rank on its own device; rank 0's output
is what is judged. :func:`generate` runs once. :func:`time_case` prepares once (models, SP
groups: not timed), then ``warmup`` untimed runs, then ``runs`` timed ones, and reports the
median of every value in the shape of an sglang perf scenario (see :mod:`harness.baselines.perf`),
so it is checked against a baseline as it is and can become one through ``parity recalibrate perf``::

    {"expected_e2e_ms": 41.2,
     "stages_ms": {"TextEncodingStage": 3.1, "DenoisingStage": 30.0, "DecodingStage": 8.1},
     "denoise_step_ms": {"0": 7.6, "1": 7.4, ...},
     "expected_avg_denoise_ms": 7.5, "expected_median_denoise_ms": 7.5,
     "calibration": {"launch_us": 4.1, "gemm_ms": 0.09, "sdpa_ms": 0.21},
     # extras (kept in results, never written into a baseline):
     "peak_memory_mb": 512.3, "peak_memory_kind": "rss_peak", "clock": "perf_counter",
     "runs": 3, "warmup": 1, "world_size": 2}

``calibration`` is :mod:`harness.gate.calibration`'s probes, measured by rank 0 (the others
waiting) right before and right after the timed runs, the minimum of the two kept; a baseline
keeps it so a run on another machine can be gated normalised.

Every value is the median over the N timed runs of that value (the average and median step of
each run first, then their median over runs). Peak memory is the largest over the ranks, over
the timed runs: on CUDA ``torch.cuda.max_memory_allocated`` (tensors only, the resident
weights included; kind ``cuda_max_allocated``); on Linux CPU the process's peak RSS after resetting it through
``/proc/self/clear_refs`` (whole process, libraries included; kind ``rss_peak``); elsewhere the
lifetime peak RSS of the rank process (``rss_lifetime_peak``: an upper bound, since a pool rank
has run other cases before).
"""

from __future__ import annotations

import resource
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cases.image import ImageCase
from harness.gate import calibration  # noqa: F401 - a module
from harness.ranks import PoolSet, rank_device
from harness.targets.base import PipelineOutput, Timings
from harness.targets.loader import load_pipeline_target

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def generate_on_rank(pipeline: str, fields: Mapping[str, Any]) -> PipelineOutput | None:
    """Rank worker: one run of ``fields`` with SP over the whole group; rank 0 returns its output.

    Module level so a RankPool can pickle a reference to it. The device is the rank's own
    (``rank_device()``: one GPU per rank, or the shared one), not the parent's.
    """
    import torch.distributed as dist

    prepared = load_pipeline_target(pipeline).prepare(fields, str(rank_device()))
    try:
        output = prepared.run()
    finally:
        prepared.close()
    return output if dist.get_rank() == 0 else None


def generate(case: ImageCase, pools: PoolSet, pipeline: str = "reference", timeout: float | None = None) -> PipelineOutput:
    """Run ``case`` on ``case.world_size`` ranks of ``pools`` and return rank 0's output.

    One rank runs in a 1-rank pool too, so every case (and its reference) runs in the same
    process setup (a rank's thread count, its device) and only the SP degree differs.
    """
    output = pools.get(case.world_size).run(generate_on_rank, pipeline, case.fields, timeout=timeout)[0]
    if output is None:
        raise RuntimeError(f"{case.id}: rank 0 returned no output")
    return output


# ----------------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class RankTiming:
    """What one rank sends back: its timed runs' timings (rank 0 only) and its peak memory."""

    timings: list[Timings] | None
    peak_memory_bytes: int
    peak_memory_kind: str
    calibration: dict[str, float] | None = None


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


def time_on_rank(pipeline: str, fields: Mapping[str, Any], warmup: int, runs: int) -> RankTiming:
    """Rank worker: prepare once (not timed), ``warmup`` untimed runs, then ``runs`` timed ones; rank 0 returns the timings.

    Prepared once, as a server is: NCCL creates a communicator lazily at a group's first
    collective, so the warm-up pays that with the first-call kernel and allocator costs.
    """
    import torch.distributed as dist

    device = str(rank_device())
    prepared = load_pipeline_target(pipeline).prepare(fields, device)
    try:
        for _ in range(warmup):
            prepared.run()
        before = _calibrate(device)
        kind = _reset_peak_memory(device)
        results = [prepared.run() for _ in range(runs)]
        peak = _peak_memory_bytes(device, kind)
        after = _calibrate(device)
    finally:
        prepared.close()
    if dist.get_rank() != 0:
        return RankTiming(None, peak, kind)
    assert before is not None and after is not None
    return RankTiming([r.timings for r in results], peak, kind, calibration.combine([before, after]))


def _calibrate(device: str) -> dict[str, float] | None:
    """Rank 0 measures the calibration probes while the other ranks wait (they would disturb it)."""
    import torch.distributed as dist

    dist.barrier()
    probes = calibration.measure(device) if dist.get_rank() == 0 else None
    dist.barrier()
    return probes


def median_scenario(timings: Sequence[Timings]) -> dict[str, Any]:
    """The median over runs of every value, in the shape of a perf scenario (no extras)."""
    if not timings:
        raise ValueError("median_scenario needs at least one run")
    steps = {len(t.denoise_step_ms) for t in timings}
    if len(steps) != 1:
        raise ValueError(f"runs differ in their number of denoising steps: {sorted(steps)}")

    def med(values: Sequence[float]) -> float:
        return float(statistics.median(values))

    scenario: dict[str, Any] = {
        "expected_e2e_ms": med([t.e2e_ms for t in timings]),
        "stages_ms": {name: med([t.stages_ms[name] for t in timings]) for name in timings[0].stages_ms},
        "denoise_step_ms": {str(i): med([t.denoise_step_ms[i] for t in timings]) for i in range(steps.pop())},
    }
    with_steps = [t for t in timings if t.denoise_step_ms]
    if with_steps:
        scenario["expected_avg_denoise_ms"] = med([statistics.fmean(t.denoise_step_ms) for t in with_steps])
        scenario["expected_median_denoise_ms"] = med([statistics.median(t.denoise_step_ms) for t in with_steps])
    return scenario


@dataclass(frozen=True)
class CaseTiming:
    """The timed runs of one case (rank 0's clock) and every rank's peak memory."""

    case_id: str
    world_size: int
    warmup: int
    timings: list[Timings]
    peak_memory_bytes: list[int]
    peak_memory_kind: str
    calibration: dict[str, float] | None = None

    def measured(self) -> dict[str, Any]:
        """The perf-scenario-shaped measurement (module docstring), extras included."""
        return {
            **median_scenario(self.timings),
            **({"calibration": self.calibration} if self.calibration else {}),
            "peak_memory_mb": round(max(self.peak_memory_bytes) / 2**20, 1),
            "peak_memory_kind": self.peak_memory_kind,
            "clock": self.timings[0].clock,
            "runs": len(self.timings),
            "warmup": self.warmup,
            "world_size": self.world_size,
        }


def time_case(case: ImageCase, pools: PoolSet, pipeline: str = "reference", *, runs: int = 3, warmup: int = 1,
              timeout: float | None = None) -> CaseTiming:
    """Time ``case`` on ``case.world_size`` ranks of ``pools``: ``warmup`` runs, then ``runs`` timed ones."""
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    per_rank: list[RankTiming] = pools.get(case.world_size).run(time_on_rank, pipeline, case.fields, warmup, runs,
                                                                timeout=timeout)
    timings = per_rank[0].timings
    if not timings:
        raise RuntimeError(f"{case.id}: rank 0 returned no timings")
    return CaseTiming(case.id, case.world_size, warmup, timings, [r.peak_memory_bytes for r in per_rank],
                      per_rank[0].peak_memory_kind, per_rank[0].calibration)
