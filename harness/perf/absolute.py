"""One pipeline's timings as a perf scenario: ``warmup`` untimed runs, ``runs`` timed ones, the median of each value.

The measurement has the shape of an sglang perf scenario (:mod:`harness.baselines.perf`), so it is
checked against a stored baseline as it is and becomes one through ``parity recalibrate perf``;
values are raw (what the clocks read), never rescaled. Extras, kept in results and never written
into a baseline: ``wall_ms`` (parity's clock), every run's values (``samples``), peak memory.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from harness.baselines.perf import scenario_values, set_scenario_values
from harness.perf.figures import WALL, run_figures
from harness.pipelines.sessions import Session, TimedRun

SAMPLES = "samples"


def median_scenario(figures: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """The median over runs of every scenario value (``run_figures`` of each run), in a scenario's shape."""
    if not figures:
        raise ValueError("median_scenario needs at least one run")
    steps = {sum(label.startswith("denoise_step_ms.") for label in run) for run in figures}
    if len(steps) != 1:
        raise ValueError(f"runs differ in their number of denoising steps: {sorted(steps)}")
    labels = [label for label in figures[0] if label != WALL]
    return set_scenario_values({}, {label: float(statistics.median(run[label] for run in figures)) for label in labels})


def measure(session: Session, *, runs: int, warmup: int) -> dict[str, Any]:
    """Time ``runs`` runs of a prepared session after ``warmup`` untimed ones (module docstring)."""
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    for _ in range(warmup):
        session.run()
    timed: list[TimedRun] = [session.run() for _ in range(runs)]
    return measurement(timed, warmup)


def measurement(timed: Sequence[TimedRun], warmup: int) -> dict[str, Any]:
    """The scenario-shaped measurement of timed runs, extras included."""
    figures = [run_figures(r) for r in timed]
    scenario = median_scenario(figures)
    peaks = [p for r in timed for p in r.peak_memory_bytes]
    return {
        **scenario,
        WALL: float(statistics.median(f[WALL] for f in figures)),
        SAMPLES: {label: [f[label] for f in figures] for label in [WALL, *scenario_values(scenario)]},
        "peak_memory_mb": round(max(peaks) / 2**20, 1) if peaks else None,
        "peak_memory_kind": timed[0].peak_memory_kind,
        "clock": timed[0].timings.clock,
        "runs": len(timed),
        "warmup": warmup,
    }
