"""One timed run as flat figures, and the tolerance family each figure is judged with.

The labels are those of a perf scenario (:func:`harness.baselines.perf.scenario_values`:
``expected_e2e_ms``, ``stages_ms.<stage>``, ``denoise_step_ms.<i>``, the step average and median),
plus ``wall_ms``: parity's own clock of the run, kept apart from the timings the target reports
(an external command's own ``timings.json`` is not parity's measurement of it).
"""

from __future__ import annotations

import statistics

from harness.baselines.perf import AVG, E2E, MEDIAN, STAGES, STEPS, tolerance_category
from harness.baselines.tolerances import WALL as WALL_FAMILY
from harness.pipelines.sessions import TimedRun

WALL = "wall_ms"


def run_figures(run: TimedRun) -> dict[str, float]:
    """``{label: ms}`` of one run (module docstring)."""
    t = run.timings
    figures = {WALL: run.wall_ms, E2E: t.e2e_ms}
    figures.update({f"{STAGES}.{name}": ms for name, ms in t.stages_ms.items()})
    figures.update({f"{STEPS}.{i}": ms for i, ms in enumerate(t.denoise_step_ms)})
    if t.denoise_step_ms:
        figures[AVG] = statistics.fmean(t.denoise_step_ms)
        figures[MEDIAN] = statistics.median(t.denoise_step_ms)
    return figures


def family(label: str) -> str:
    """The tolerance family of a figure (parity's wall clock has its own, :data:`harness.baselines.tolerances.WALL`)."""
    return WALL_FAMILY if label == WALL else tolerance_category(label)
