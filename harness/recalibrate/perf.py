"""Perf proposals: a new baseline value per measured value from N gate runs, and the noise it stands on.

The median of the N raw measurements of each value; it changes only when ``|median - old| / old >
tolerance / 3`` (so noise inside the gate's slack does not churn the baseline) and is then rounded to
4 significant figures. A higher expected time is a loosening, refused unless allowed
(:mod:`.proposals`). Each proposal carries its runs' spread (the largest relative distance of a run
from the median): a tolerance no wider than that would fail an unchanged tree, so writing it is
refused (:func:`refuse_inside_noise`); the written scenario records every spread (``dispersion``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines.perf import (
    DISPERSION,
    PerfBaselines,
    Tolerances,
    scenario_values,
    set_scenario_values,
    tolerance_category,
)
from harness.errors import ConfigError
from harness.files.reading import is_present
from harness.recalibrate.proposals import change_word, fmt, refuse_loosening

_PERF_SIGNIFICANT = 4
_SPREAD_DIGITS = 3


class NoiseRefused(ConfigError):
    """Raised instead of writing a baseline whose tolerances the measured noise already reaches."""


@dataclass(frozen=True)
class PerfProposal:
    """A proposed baseline value (label as in :func:`harness.baselines.perf.scenario_values`).

    ``old`` is None for a value the baseline lacks (a new scenario or stage); adding it is a
    change but not a loosening. ``spread``: the runs' largest relative distance from ``median``;
    ``tolerance``: what the gate allows that value.
    """

    scenario_id: str
    metric: str
    old: float | None
    median: float
    new: float
    changed: bool
    loosens: bool
    spread: float = 0.0
    tolerance: float = float("inf")

    @property
    def inside_noise(self) -> bool:
        return self.tolerance <= self.spread

    def describe(self) -> str:
        """One line for messages: ``flux_image_t2i.expected_e2e_ms: 6693 -> 7400 (median 7400.2)``."""
        return f"{self.scenario_id}.{self.metric}: {fmt(self.old)} -> {fmt(self.new)} (median {fmt(self.median)})"


def _round_significant(value: float, digits: int = _PERF_SIGNIFICANT) -> float:
    return float(f"{value:.{digits}g}")


def spread(values: Sequence[float]) -> float:
    """The largest relative distance of a value from the median (0 for one value, or a median of 0)."""
    median = statistics.median(values)
    return max(abs(v - median) for v in values) / median if median > 0 else 0.0


def _measurements(results_list: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for doc in results_list:
        for scenario_id, measured in doc.get("perf", {}).items():
            by_scenario.setdefault(scenario_id, []).append(measured)
    return by_scenario


def propose_perf(
    baseline: PerfBaselines, results_list: Sequence[dict[str, Any]], tolerances: Tolerances
) -> list[PerfProposal]:
    """Per measured value: median of the runs that have it, changed only beyond tolerance/3.

    Baseline values that no run measured are left as they are (removing a stage is a manual,
    reviewed edit, not something a missing measurement should do).
    """
    proposals = []
    for scenario_id, runs in _measurements(results_list).items():
        old_values = scenario_values(baseline.scenario(scenario_id) or {})
        samples: dict[str, list[float]] = {}
        for run in runs:
            for label, value in scenario_values(run).items():
                samples.setdefault(label, []).append(value)
        for label, values in samples.items():
            median = float(statistics.median(values))
            tolerance = tolerances.get(tolerance_category(label))
            noise = {"spread": spread(values), "tolerance": tolerance}
            old = old_values.get(label)
            if old is None:
                proposals.append(
                    PerfProposal(scenario_id, label, None, median, _round_significant(median), True, False, **noise)
                )
                continue
            moved = median != 0.0 if old == 0.0 else abs(median - old) / old > tolerance / 3.0
            new = _round_significant(median) if moved else old
            proposals.append(PerfProposal(scenario_id, label, old, median, new, moved, moved and new > old, **noise))
    return proposals


def refuse_inside_noise(proposals: Iterable[PerfProposal]) -> None:
    """Refuse (nothing written) when any value's tolerance is no wider than its runs' spread."""
    noisy = [p for p in proposals if p.inside_noise]
    if noisy:
        lines = [f"{p.describe()}: runs spread ±{p.spread:.1%}, tolerance {p.tolerance:.1%}" for p in noisy]
        raise NoiseRefused(
            f"refusing to write {len(noisy)} value(s) whose tolerance is inside the measured noise (an unchanged tree "
            "would fail on them); nothing was written. Widen the profile's tolerances (or PARITY_PERF_TOL_*), "
            "measure on a quieter runner, or gate side by side with --perf-base:\n  " + "\n  ".join(lines)
        )


def apply_perf_proposals(
    baseline: PerfBaselines, proposals: Sequence[PerfProposal], allow_loosen: bool = False
) -> PerfBaselines:
    """``baseline`` with the changed values written, and each rewritten scenario's ``dispersion``;
    :class:`LooseningRefused` if any would raise an expected time without ``allow_loosen`` (a slowdown
    must be accepted explicitly), :class:`NoiseRefused` if a tolerance is inside the noise."""
    refuse_loosening(proposals, allow_loosen)
    refuse_inside_noise(proposals)
    updates: dict[str, dict[str, float]] = {}
    for p in proposals:
        if p.changed:
            updates.setdefault(p.scenario_id, {})[p.metric] = p.new
    for scenario_id, values in updates.items():
        scenario = set_scenario_values(baseline.scenario(scenario_id) or {}, values)
        scenario[DISPERSION] = {
            p.metric: round(p.spread, _SPREAD_DIGITS) for p in proposals if p.scenario_id == scenario_id
        }
        baseline = baseline.with_scenario(scenario_id, scenario)
    return baseline


def merge_into_perf_overlay(
    overlay_path: str | Path,
    chain: PerfBaselines,
    proposals: Sequence[PerfProposal],
    platform: str,
    hardware: Sequence[str] = (),
    allow_loosen: bool = False,
) -> PerfBaselines:
    """Write changed proposals into the perf overlay of ``platform`` alone (created when absent, with
    ``hardware`` as its metadata), atomically with ``.bak``; returns the overlay as written.

    A scenario the machine gated against from the base file (``chain``) is copied whole into the
    overlay first: an overlay scenario replaces the base one whole, so copying only the changed
    values would drop the others.
    """
    path = Path(overlay_path)
    existed = is_present(path)
    if existed:
        overlay = PerfBaselines.load(path)
    else:
        metadata = {
            "hardware": ", ".join(hardware) or platform,
            "platform": platform,
            "written_by": "parity recalibrate perf",
        }
        overlay = PerfBaselines.from_json({"metadata": metadata, "scenarios": {}}, str(path))
    for scenario_id in {p.scenario_id for p in proposals if p.changed}:
        inherited = chain.scenario(scenario_id)
        if overlay.scenario(scenario_id) is None and inherited is not None:
            overlay = overlay.with_scenario(scenario_id, inherited)
    updated = apply_perf_proposals(overlay, proposals, allow_loosen)
    updated.save(path, backup=existed)
    return updated


PERF_PROPOSAL_HEADER: tuple[str, ...] = ("scenario", "value", "old", "median", "new", "spread", "change")


def perf_proposal_rows(proposals: Iterable[PerfProposal]) -> list[tuple[str, ...]]:
    """Table rows (strings) matching :data:`PERF_PROPOSAL_HEADER`; a spread the tolerance does not clear is marked."""
    return [
        (
            p.scenario_id,
            p.metric,
            fmt(p.old),
            fmt(p.median),
            fmt(p.new),
            f"±{p.spread:.1%}" + (f" ≥ tol {p.tolerance:.0%}" if p.inside_noise else ""),
            "added" if p.old is None else change_word(p.changed, p.loosens),
        )
        for p in proposals
    ]
