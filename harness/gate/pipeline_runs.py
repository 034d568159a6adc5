"""What the image and perf stages (and ``parity bless``) run: a pipeline target's generations.

Both run an image case on ``case.world_size`` ranks of a live pool through the case's pipeline
target (:class:`~harness.targets.base.PipelineTarget`, built in each rank from ``case.target`` and
``case.target_args``), each rank on its own device; rank 0's output is what is judged. A target
that starts its own processes (``runs_in_ranks`` False: an external command) runs in this
process instead, once per run, with no rank group: the ranks would only hold devices the
command needs. :func:`generate` runs once. :func:`time_case` prepares once (models, SP
groups: not timed), then ``warmup`` untimed runs, then ``runs`` timed ones, and reports the
median of every value in the shape of an sglang perf scenario (see :mod:`harness.baselines.perf`),
so it is checked against a baseline as it is and can become one through ``parity recalibrate perf``::

    {"expected_e2e_ms": 41.2,
     "stages_ms": {"TextEncodingStage": 3.1, "DenoisingStage": 30.0, "DecodingStage": 8.1},
     "denoise_step_ms": {"0": 7.6, "1": 7.4, ...},
     "expected_avg_denoise_ms": 7.5, "expected_median_denoise_ms": 7.5,
     "calibration": {"launch_us": 4.1, "module_us": 30.2, "gemm_ms": 0.09, "sdpa_ms": 0.21, "comm_us": 95.0,
                     "step_ms": 1.9},
     # extras (kept in results, never written into a baseline):
     "calibration_readings": [{...}, ...], "run_scales": [1.01, 0.99, 1.0], "runs_e2e_ms": [41.0, 41.6, 41.2],
     "peak_memory_mb": 512.3, "peak_memory_kind": "rss_peak", "clock": "perf_counter",
     "runs": 3, "warmup": 1, "world_size": 2}

``calibration`` is :mod:`harness.gate.calibration`'s probes, read by every rank at once (rank 0's
reading kept; for a target run here, by this process): every probe before the target is
prepared and after the last timed run, the synthetic step before each timed run; the median of
the readings is kept, each reading is in the extras (``calibration_readings``). A baseline keeps
the calibration, so a run on another machine can be gated normalised.

Every value is the median over the N timed runs of that value, each run first brought to the
case's typical machine speed (times its ``run_scales`` entry: the case's synthetic-step reading
over the readings around that run, :func:`harness.gate.calibration.run_scales`; the raw
end-to-end times stay in ``runs_e2e_ms``); the average and median step are taken per run first.
Peak memory is the largest over the ranks, over
the timed runs: on CUDA ``torch.cuda.max_memory_allocated`` (tensors only, the resident
weights included; kind ``cuda_max_allocated``); on Linux CPU the process's peak RSS after resetting it through
``/proc/self/clear_refs`` (whole process, libraries included; kind ``rss_peak``); elsewhere the
lifetime peak RSS of the rank process (``rss_lifetime_peak``: an upper bound, since a pool rank
has run other cases before). A target run in this process has its memory in processes parity
does not own: ``peak_memory_mb`` is null, kind ``not_measured``.
"""

from __future__ import annotations

import resource
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines.perf import CALIBRATION
from harness.cases.image import ImageCase
from harness.gate import calibration  # noqa: F401 - a module
from harness.ranks import PoolSet, rank_device
from harness.targets.base import PipelineOutput, PipelineTarget, PreparedPipeline, Timings
from harness.targets.loader import TargetArgs, load_pipeline_target

NOT_MEASURED = "not_measured"  # a target run in this process: its memory is in processes parity does not own
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def pipeline_of(case: ImageCase) -> PipelineTarget:
    """The case's pipeline target, as this process builds it (cached)."""
    return load_pipeline_target(case.target, case.target_args)


def unavailable(case: ImageCase, device: str) -> str | None:
    """Why the case cannot run on this machine (it is then skipped with this), or None."""
    return pipeline_of(case).unavailable_reason(device, case.world_size)


def needs_ranks(case: ImageCase) -> bool:
    """Whether the case runs in a rank group (False: its target starts its own processes)."""
    return pipeline_of(case).runs_in_ranks


def _prepare_here(case: ImageCase, device: str) -> PreparedPipeline:
    return pipeline_of(case).prepare(case.fields, device, case.world_size)


def generate_on_rank(pipeline: str, args: TargetArgs, fields: Mapping[str, Any]) -> PipelineOutput | None:
    """Rank worker: one run of ``fields`` with SP over the whole group; rank 0 returns its output.

    Module level so a RankPool can pickle a reference to it. The device is the rank's own
    (``rank_device()``: one GPU per rank, or the shared one), not the parent's.
    """
    import torch.distributed as dist

    prepared = load_pipeline_target(pipeline, args).prepare(fields, str(rank_device()))
    try:
        output = prepared.run()
    finally:
        prepared.close()
    return output if dist.get_rank() == 0 else None


def generate(case: ImageCase, pools: PoolSet, timeout: float | None = None) -> PipelineOutput:
    """Run ``case`` on ``case.world_size`` ranks of ``pools`` and return rank 0's output.

    One rank runs in a 1-rank pool too, so every case (and its reference) runs in the same
    process setup (a rank's thread count, its device) and only the SP degree differs. A target
    that starts its own processes runs here (its own timeout bounds it).
    """
    if not needs_ranks(case):
        prepared = _prepare_here(case, pools.device)
        try:
            return prepared.run()
        finally:
            prepared.close()
    output = pools.get(case.world_size).run(generate_on_rank, case.target, case.target_args, case.fields, timeout=timeout)[0]
    if output is None:
        raise RuntimeError(f"{case.id}: rank 0 returned no output")
    return output


# ----------------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class RankTiming:
    """What one rank sends back: its timed runs' timings and calibration readings (rank 0 only) and its peak memory."""

    timings: list[Timings] | None
    peak_memory_bytes: int | None
    peak_memory_kind: str
    calibration_readings: list[dict[str, float]] | None = None


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


def time_on_rank(pipeline: str, args: TargetArgs, fields: Mapping[str, Any], warmup: int, runs: int) -> RankTiming:
    """Rank worker: prepare once (not timed), ``warmup`` untimed runs, then ``runs`` timed ones; rank 0 returns the timings.

    Prepared once, as a server is: NCCL creates a communicator lazily at a group's first
    collective, so the warm-up pays that with the first-call kernel and allocator costs.
    """
    import torch.distributed as dist

    device = str(rank_device())
    rank0 = dist.get_rank() == 0
    timing = _time_runs(lambda: load_pipeline_target(pipeline, args).prepare(fields, device), device, warmup, runs,
                        _Group(rank0, dist.barrier), in_ranks=True)
    return timing if rank0 else RankTiming(None, timing.peak_memory_bytes, timing.peak_memory_kind)


@dataclass(frozen=True)
class _Group:
    """The processes timing one case together: this one alone, or the ranks of a pool."""

    rank0: bool
    barrier: Callable[[], Any]


_HERE = _Group(True, lambda: None)


def _time_runs(prepare: Callable[[], PreparedPipeline], device: str, warmup: int, runs: int, group: _Group,
               in_ranks: bool) -> RankTiming:
    """Prepare, warm-up, the timed runs with a calibration reading before each and after the last.

    The first reading (every probe) comes before the target's code runs in this process for the
    case, so nothing the target sets up (a patched kernel, a changed thread count) slows every
    reading with it; the readings between runs are the synthetic step alone (milliseconds); the
    last reading has every probe again.
    """
    readings = [_calibrate(calibration.measure, device, group)]
    prepared = prepare()
    try:
        for _ in range(warmup):
            prepared.run()
        kind = _reset_peak_memory(device) if in_ranks else NOT_MEASURED
        results = []
        for _ in range(runs):
            readings.append(_calibrate(calibration.measure_step, device, group))
            results.append(prepared.run())
        peak = _peak_memory_bytes(device, kind) if in_ranks else None
        readings.append(_calibrate(calibration.measure, device, group))
    finally:
        prepared.close()
    kept = [r for r in readings if r is not None]
    return RankTiming([r.timings for r in results], peak, kind, kept or None)


def _calibrate(probe: Callable[[str], dict[str, float]], device: str, group: _Group) -> dict[str, float] | None:
    """Every rank reads the probes at once (:func:`harness.gate.calibration.measure`); rank 0's reading is kept."""
    group.barrier()
    reading = probe(device)
    return reading if group.rank0 else None


def median_scenario(timings: Sequence[Timings], scales: Sequence[float] | None = None) -> dict[str, Any]:
    """The median over runs of every value, in the shape of a perf scenario (no extras); with
    ``scales``, each run's values times its scale first (:func:`harness.gate.calibration.run_scales`)."""
    if not timings:
        raise ValueError("median_scenario needs at least one run")
    steps = {len(t.denoise_step_ms) for t in timings}
    if len(steps) != 1:
        raise ValueError(f"runs differ in their number of denoising steps: {sorted(steps)}")
    if scales is not None and len(scales) != len(timings):
        raise ValueError(f"{len(scales)} scales for {len(timings)} runs")
    k = list(scales) if scales is not None else [1.0] * len(timings)

    def med(values: Sequence[float]) -> float:
        return float(statistics.median(v * ki for v, ki in zip(values, k)))

    scenario: dict[str, Any] = {
        "expected_e2e_ms": med([t.e2e_ms for t in timings]),
        "stages_ms": {name: med([t.stages_ms[name] for t in timings]) for name in timings[0].stages_ms},
        "denoise_step_ms": {str(i): med([t.denoise_step_ms[i] for t in timings]) for i in range(steps.pop())},
    }
    if timings[0].denoise_step_ms:
        scenario["expected_avg_denoise_ms"] = med([statistics.fmean(t.denoise_step_ms) for t in timings])
        scenario["expected_median_denoise_ms"] = med([statistics.median(t.denoise_step_ms) for t in timings])
    return scenario


@dataclass(frozen=True)
class CaseTiming:
    """The timed runs of one case (rank 0's clock), every rank's peak memory, rank 0's calibration readings."""

    case_id: str
    world_size: int
    warmup: int
    timings: list[Timings]
    peak_memory_bytes: list[int]  # one per rank; empty when not measured
    peak_memory_kind: str
    calibration_readings: list[dict[str, float]] | None = None

    def measured(self) -> dict[str, Any]:
        """The perf-scenario-shaped measurement (module docstring), extras included."""
        readings = self.calibration_readings or []
        scales = calibration.run_scales(readings, len(self.timings)) if readings else None
        return {
            **median_scenario(self.timings, scales),
            **({CALIBRATION: calibration.combine(readings)} if readings else {}),
            "calibration_readings": readings,
            "run_scales": scales,
            "runs_e2e_ms": [t.e2e_ms for t in self.timings],
            "peak_memory_mb": round(max(self.peak_memory_bytes) / 2**20, 1) if self.peak_memory_bytes else None,
            "peak_memory_kind": self.peak_memory_kind,
            "clock": self.timings[0].clock,
            "runs": len(self.timings),
            "warmup": self.warmup,
            "world_size": self.world_size,
        }


def time_case(case: ImageCase, pools: PoolSet, *, runs: int, warmup: int = 1,
              timeout: float | None = None) -> CaseTiming:
    """Time ``case`` on ``case.world_size`` ranks of ``pools`` (or here, for a target that starts its own
    processes): ``warmup`` runs, then ``runs`` timed ones."""
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    if needs_ranks(case):
        per_rank: list[RankTiming] = pools.get(case.world_size).run(
            time_on_rank, case.target, case.target_args, case.fields, warmup, runs, timeout=timeout)
    else:
        per_rank = [_time_runs(lambda: _prepare_here(case, pools.device), pools.device, warmup, runs, _HERE, in_ranks=False)]
    first = per_rank[0]
    if not first.timings:
        raise RuntimeError(f"{case.id}: rank 0 returned no timings")
    peaks = [r.peak_memory_bytes for r in per_rank if r.peak_memory_bytes is not None]
    return CaseTiming(case.id, case.world_size, warmup, first.timings, peaks, first.peak_memory_kind,
                      first.calibration_readings)
