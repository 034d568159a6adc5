"""Timing of an image case: warm-up runs, then N timed runs, the median of every value, peak memory.

A case runs on ``case.world_size`` ranks of a live pool (the image case runner's pools), with
the case's pipeline config on each rank's own device, as the image stage runs it; an SP case
times all its ranks working together and rank 0's clock is reported. The models and the SP
groups are set up once per case, before the warm-up (see :func:`time_on_rank`); building them
is not timed. Stage times come from the pipeline's own
:class:`~reference_impl.pipeline.StageTimings`: CUDA events on a GPU (read once at the end of a
run, no syncs mid-run), ``perf_counter`` on a CPU.

The measurement is written in the shape of an sglang perf scenario (see
:mod:`harness.baselines.perf`), so it is checked against a baseline as it is and can become
one through ``parity recalibrate perf``::

    {"expected_e2e_ms": 41.2,
     "stages_ms": {"TextEncodingStage": 3.1, "DenoisingStage": 30.0, "DecodingStage": 8.1},
     "denoise_step_ms": {"0": 7.6, "1": 7.4, ...},
     "expected_avg_denoise_ms": 7.5, "expected_median_denoise_ms": 7.5,
     # extras (kept in results, never written into a baseline):
     "peak_memory_mb": 512.3, "peak_memory_kind": "rss_peak", "clock": "perf_counter",
     "runs": 3, "warmup": 1, "world_size": 2}

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.image_cases import ImageCase, PoolGetter
    from reference_impl.pipeline import PipelineConfig, StageTimings

__all__ = ["STAGE_NAMES", "RankTiming", "CaseTiming", "time_on_rank", "time_image_case", "median_scenario", "hardware_name"]

#: The pipeline's stage names → sglang's stage names (``is_denoise_stage`` knows the denoising one).
STAGE_NAMES = {"text_encoding": "TextEncodingStage", "denoising": "DenoisingStage", "decoding": "DecodingStage"}
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


@dataclass(frozen=True)
class RankTiming:
    """What one rank sends back: its timed runs' timings (rank 0 only) and its peak memory."""

    timings: list[StageTimings] | None
    peak_memory_bytes: int
    peak_memory_kind: str


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


def time_on_rank(config: PipelineConfig, warmup: int, runs: int) -> RankTiming:
    """Rank worker: SP over the whole group and the models set up once, ``warmup`` untimed runs,
    then ``runs`` timed ones; rank 0 returns the timings. Module level so a RankPool can pickle it.

    Set up once, as a server is: ``run_pipeline_sequence_parallel`` (what the image stage runs)
    makes new SP sub-groups on every call, and NCCL creates a communicator lazily at a group's
    first collective, so timing it run by run would time communicator set-up inside the first
    denoising step. Here the warm-up pays it, with the first-call kernel and allocator costs.
    """
    import dataclasses

    import torch.distributed as dist

    from harness.launcher import rank_device
    from reference_impl.parallel.state import destroy_sequence_parallel, init_sequence_parallel
    from reference_impl.pipeline import build_models, run_pipeline

    device = str(rank_device())
    config = dataclasses.replace(config, device=device)
    init_sequence_parallel(dist.get_world_size(), 1)
    try:
        models = build_models(config)
        for _ in range(warmup):
            run_pipeline(config, models)
        kind = _reset_peak_memory(device)
        results = [run_pipeline(config, models) for _ in range(runs)]
        peak = _peak_memory_bytes(device, kind)
    finally:
        destroy_sequence_parallel()
    return RankTiming([r.timings for r in results] if dist.get_rank() == 0 else None, peak, kind)


def median_scenario(timings: Sequence[StageTimings]) -> dict[str, Any]:
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
        "stages_ms": {STAGE_NAMES[name]: med([t.stages_ms[name] for t in timings]) for name in STAGE_NAMES},
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
    timings: list[StageTimings]
    peak_memory_bytes: list[int]
    peak_memory_kind: str

    def measured(self) -> dict[str, Any]:
        """The perf-scenario-shaped measurement (module docstring), extras included."""
        return {
            **median_scenario(self.timings),
            "peak_memory_mb": round(max(self.peak_memory_bytes) / 2**20, 1),
            "peak_memory_kind": self.peak_memory_kind,
            "clock": self.timings[0].clock,
            "runs": len(self.timings),
            "warmup": self.warmup,
            "world_size": self.world_size,
        }


def time_image_case(case: ImageCase, pools: PoolGetter, device: str = "cpu", *, runs: int = 3, warmup: int = 1,
                    timeout: float | None = None) -> CaseTiming:
    """Time ``case`` on ``case.world_size`` ranks of ``pools(world)``: ``warmup`` runs, then ``runs`` timed ones."""
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    per_rank: list[RankTiming] = pools(case.world_size).run(time_on_rank, case.config(device), warmup, runs, timeout=timeout)
    timings = per_rank[0].timings
    if not timings:
        raise RuntimeError(f"{case.id}: rank 0 returned no timings")
    return CaseTiming(case.id, case.world_size, warmup, timings, [r.peak_memory_bytes for r in per_rank], per_rank[0].peak_memory_kind)


def hardware_name(device: str = "cpu") -> str:
    """A human-readable name of the hardware (a perf overlay's ``metadata.hardware``)."""
    import os
    import platform

    import torch

    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(torch.device(device)))
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()} ({os.cpu_count()} logical CPUs)"
