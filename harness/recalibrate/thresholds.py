"""Threshold proposals: a new bound per (case, metric) from the worst of N gate runs, by the policy.

Thresholds go to the base ``consistency_threshold.json`` or to a platform overlay
(:func:`merge_into_overlay`); a loosening is refused unless allowed (:mod:`.proposals`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines.thresholds import HIGHER_IS_BETTER, METRICS, ThresholdSet
from harness.errors import ConfigError
from harness.files.reading import is_present
from harness.recalibrate.policy import DEFAULT_POLICY, Policy
from harness.recalibrate.proposals import change_word, fmt, refuse_loosening


@dataclass(frozen=True)
class Proposal:
    """A proposed threshold for one case and metric; ``loosens`` = less strict than ``old``."""

    case_id: str
    metric: str
    old: float
    worst: float
    new: float
    loosens: bool

    @property
    def changed(self) -> bool:
        """Whether applying the proposal alters the effective threshold."""
        return self.new != self.old

    def describe(self) -> str:
        """One line for messages: ``flux_image_t2i.psnr: 24 -> 21.5 (worst 24.5)``."""
        return f"{self.case_id}.{self.metric}: {fmt(self.old)} -> {fmt(self.new)} (worst {fmt(self.worst)})"


def _case_kinds(results: Sequence[dict[str, Any]], paths: Sequence[str | Path]) -> dict[str, str]:
    """Each case's kind; a case recorded as an image in one results file and as a video in another is a
    ConfigError naming both files (``paths``, one per document; ``results #i`` without them)."""
    kinds: dict[str, tuple[str, str]] = {}
    for i, doc in enumerate(results):
        where = str(paths[i]) if i < len(paths) else f"results #{i + 1}"
        for case_id, case in doc["cases"].items():
            kind, first = kinds.setdefault(case_id, (case["kind"], where))
            if kind != case["kind"]:
                raise ConfigError(
                    f"case {case_id!r} is recorded as {case['kind']} here but as {kind} in {first}",
                    path=where,
                    key=f"cases.{case_id}.kind",
                )
    return {case_id: kind for case_id, (kind, _) in kinds.items()}


def propose_thresholds(
    current: ThresholdSet,
    results: Sequence[dict[str, Any]],
    policy: Policy = DEFAULT_POLICY,
    paths: Sequence[str | Path] = (),
) -> list[Proposal]:
    """One proposal per (case, metric) observed in ``results`` (parsed documents, see
    :func:`parse_results`, read from ``paths``); failed runs count too, which is exactly when a proposal loosens."""
    proposals = []
    for case_id, kind in _case_kinds(results, paths).items():
        old = current.for_case(case_id, kind)
        for metric in METRICS:
            runs = [doc["cases"][case_id]["metrics"] for doc in results if case_id in doc["cases"]]
            seen = [run[metric] for run in runs if run[metric] is not None]
            if not seen:
                continue
            worst = min(seen) if metric in HIGHER_IS_BETTER else max(seen)
            new = policy.threshold(metric, worst)
            old_value = old.get(metric)
            loosens = new < old_value if metric in HIGHER_IS_BETTER else new > old_value
            proposals.append(Proposal(case_id, metric, old_value, worst, new, loosens))
    return proposals


def apply_proposals(
    thresholds: ThresholdSet, proposals: Sequence[Proposal], allow_loosen: bool = False
) -> ThresholdSet:
    """``thresholds`` with the changed proposals written into its top-most file (the platform
    overlay when there is one); raises :class:`LooseningRefused` first if any would loosen."""
    refuse_loosening(proposals, allow_loosen)
    return thresholds.with_values({(p.case_id, p.metric): p.new for p in proposals if p.changed})


def merge_into_overlay(
    overlay_path: str | Path, proposals: Sequence[Proposal], allow_loosen: bool = False
) -> dict[str, Any]:
    """Write changed proposals into a per-platform overlay file (created if absent), atomically,
    keeping ``.bak`` of the previous version; returns the overlay as written.

    The proposals must have been computed against the chain this overlay belongs to (base +
    this overlay), so ``old`` is what that platform gates against today. Results from several
    machines are merged by calling this once per platform with that platform's proposals.
    """
    refuse_loosening(proposals, allow_loosen)
    path = Path(overlay_path)
    existed = is_present(path)
    existing = ThresholdSet.load(path) if existed else ThresholdSet.from_json({"cases": {}}, str(path))
    updated = existing.with_values({(p.case_id, p.metric): p.new for p in proposals if p.changed})
    updated.save(path, backup=existed)
    return updated.to_json()


PROPOSAL_HEADER: tuple[str, ...] = ("case", "metric", "old", "worst", "new", "change")


def proposal_rows(proposals: Iterable[Proposal]) -> list[tuple[str, ...]]:
    """Table rows (strings) matching :data:`PROPOSAL_HEADER`, for the CLI's diff table."""
    return [
        (p.case_id, p.metric, fmt(p.old), fmt(p.worst), fmt(p.new), change_word(p.changed, p.loosens))
        for p in proposals
    ]
