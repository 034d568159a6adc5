"""Perf proposals: a new baseline value per measured value from N gate runs.

The median of the N measurements of each value, each run first brought to the runs' typical
machine speed by its ``calibration.step_ms`` (where every run has one); a value changes only when
``|median - old| / old > tolerance / 3`` (the tolerance of that value's family, see
:mod:`harness.baselines.perf`), so noise well inside the gate's own slack does not churn the
baseline; a changed value is rounded to 4 significant figures. A higher expected time is a
loosening: refused unless allowed (:mod:`.proposals`).

A scenario's ``calibration`` (the machine's probes, :mod:`harness.gate.calibration`) must belong
to the same measurement as its timings: it is proposed as ``calibration.<probe>`` values, the
median of the runs, written whenever any timing of the scenario changes or the baseline lacks a
probe the runs measured, and never a loosening in itself.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines.perf import CALIBRATION, STEP_PROBE, PerfBaselines, Tolerances, scenario_values, set_scenario_values, tolerance_category
from harness.files.reading import is_present
from harness.recalibrate.proposals import change_word, fmt, refuse_loosening

_PERF_SIGNIFICANT = 4

@dataclass(frozen=True)
class PerfProposal:
    """A proposed baseline value (label as in :func:`harness.baselines.perf.scenario_values`).

    ``old`` is None for a value the baseline lacks (a new scenario or stage); adding it is a
    change but not a loosening.
    """

    scenario_id: str
    metric: str
    old: float | None
    median: float
    new: float
    changed: bool
    loosens: bool

    def describe(self) -> str:
        """One line for messages: ``flux_image_t2i.expected_e2e_ms: 6693 -> 7400 (median 7400.2)``."""
        return f"{self.scenario_id}.{self.metric}: {fmt(self.old)} -> {fmt(self.new)} (median {fmt(self.median)})"


def _round_significant(value: float, digits: int = _PERF_SIGNIFICANT) -> float:
    return float(f"{value:.{digits}g}")


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
        timings = _timing_proposals(baseline, scenario_id, runs, tolerances)
        proposals += timings + _calibration_proposals(baseline, scenario_id, runs, any(p.changed for p in timings))
    return proposals


def _calibration_proposals(baseline: PerfBaselines, scenario_id: str, runs: Sequence[dict[str, Any]],
                           timings_changed: bool) -> list[PerfProposal]:
    """``calibration.<probe>`` proposals: the median of the runs, written whole when a timing changed or
    the baseline's calibration lacks a probe the runs measured (a baseline from before ``step_ms``
    gains it with the readings of the same runs); otherwise the baseline's values stay."""
    old = (baseline.scenario(scenario_id) or {}).get(CALIBRATION, {})
    samples: dict[str, list[float]] = {}
    for run in runs:
        for probe, value in run.get(CALIBRATION, {}).items():
            samples.setdefault(probe, []).append(float(value))
    write = timings_changed or any(probe not in old for probe in samples)
    proposals = []
    for probe, values in samples.items():
        median = float(statistics.median(values))
        previous = old.get(probe)
        new = _round_significant(median) if write or previous is None else float(previous)
        proposals.append(PerfProposal(scenario_id, f"{CALIBRATION}.{probe}", previous, median, new,
                                      changed=new != previous, loosens=False))
    return proposals


def _timing_proposals(baseline: PerfBaselines, scenario_id: str, runs: Sequence[dict[str, Any]],
                      tolerances: Tolerances) -> list[PerfProposal]:
    proposals = []
    old_values = scenario_values(baseline.scenario(scenario_id) or {})
    samples: dict[str, list[float]] = {}
    for run, scale in zip(runs, _run_scales(runs)):
        for label, value in scenario_values(run).items():
            samples.setdefault(label, []).append(value * scale)
    for label, values in samples.items():
        median = float(statistics.median(values))
        old = old_values.get(label)
        margin = tolerances.get(tolerance_category(label)) / 3.0
        if old is None:
            new = _round_significant(median)
            proposals.append(PerfProposal(scenario_id, label, None, median, new, changed=True, loosens=False))
            continue
        moved = median != 0.0 if old == 0.0 else abs(median - old) / old > margin
        new = _round_significant(median) if moved else old
        proposals.append(PerfProposal(scenario_id, label, old, median, new, moved, moved and new > old))
    return proposals


def _run_scales(runs: Sequence[dict[str, Any]]) -> list[float]:
    """Per run, the factor that brings its timings to the runs' typical machine speed: the median
    ``step_ms`` over the run's own (all 1 when a run lacks it). Without it the median e2e could
    come from one gate and the median step reading from another, a baseline no machine measured:
    on an H200 host the 1-rank case's three gates read 63.7 / 51.3 / 50.7 ms with step readings
    1.07 / 0.80 / 0.92 ms, and the plain medians paired 51.3 with 0.92."""
    steps = [run.get(CALIBRATION, {}).get(STEP_PROBE) for run in runs]
    if any(s is None or s <= 0 for s in steps):
        return [1.0] * len(runs)
    typical = statistics.median(steps)
    return [typical / s for s in steps]


def apply_perf_proposals(
    baseline: PerfBaselines, proposals: Sequence[PerfProposal], allow_loosen: bool = False
) -> PerfBaselines:
    """``baseline`` with the changed values written; :class:`LooseningRefused` if any would
    raise an expected time without ``allow_loosen`` (a slowdown must be accepted explicitly)."""
    refuse_loosening(proposals, allow_loosen)
    updates: dict[str, dict[str, float]] = {}
    for p in proposals:
        if p.changed:
            updates.setdefault(p.scenario_id, {})[p.metric] = p.new
    prefix = f"{CALIBRATION}."
    for scenario_id, values in updates.items():
        timings = {k: v for k, v in values.items() if not k.startswith(prefix)}
        scenario = set_scenario_values(baseline.scenario(scenario_id) or {}, timings)
        probes = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
        if probes:
            scenario[CALIBRATION] = {**scenario.get(CALIBRATION, {}), **probes}
        baseline = baseline.with_scenario(scenario_id, scenario)
    return baseline


def merge_into_perf_overlay(
    overlay_path: str | Path, chain: PerfBaselines, proposals: Sequence[PerfProposal], platform: str,
    hardware: Sequence[str] = (), allow_loosen: bool = False,
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
        metadata = {"hardware": ", ".join(hardware) or platform, "platform": platform, "written_by": "parity recalibrate perf"}
        overlay = PerfBaselines.from_json({"metadata": metadata, "scenarios": {}}, str(path))
    for scenario_id in {p.scenario_id for p in proposals if p.changed}:
        inherited = chain.scenario(scenario_id)
        if overlay.scenario(scenario_id) is None and inherited is not None:
            overlay = overlay.with_scenario(scenario_id, inherited)
    updated = apply_perf_proposals(overlay, proposals, allow_loosen)
    updated.save(path, backup=existed)
    return updated


PERF_PROPOSAL_HEADER: tuple[str, ...] = ("scenario", "value", "old", "median", "new", "change")


def perf_proposal_rows(proposals: Iterable[PerfProposal]) -> list[tuple[str, ...]]:
    """Table rows (strings) matching :data:`PERF_PROPOSAL_HEADER`."""
    return [
        (p.scenario_id, p.metric, fmt(p.old), fmt(p.median), fmt(p.new),
         "added" if p.old is None else change_word(p.changed, p.loosens))
        for p in proposals
    ]
