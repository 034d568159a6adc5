"""Recalibration policy: new thresholds and perf baselines from N gate runs. Pure functions.

Threshold policy (default, after sglang PR #29824), from the worst value observed over all runs
of a case (the lowest clip/ssim/psnr, the highest mean_abs_diff):

    clip          = min(worst - 0.02, 0.98)
    ssim          = min(worst - 0.04, 0.95)
    psnr          = min(worst - 3 dB, 30 dB)
    mean_abs_diff = max(worst + 3, 4)

The cap/floor keeps a bound from becoming so tight that run-to-run noise fails it (an
identical-image run has psnr = inf and clip = ssim = 1: the cap turns that into 30 dB / 0.98 /
0.95); a lower bound never goes below 0. New values are rounded to 4 decimals *towards the safe side* (down for lower bounds, up for
mean_abs_diff) so rounding never makes the worst observed run fail. A policy file (JSON, or TOML
when its name ends in .toml) overrides any part::

    [clip]                         # {"clip": {"margin": 0.02, "cap": 0.98},
    margin = 0.02                  #  "mean_abs_diff": {"margin": 3, "floor": 4}}
    cap = 0.98
    [mean_abs_diff]
    margin = 3
    floor = 4

Perf policy: the median of the N measurements of each value; a value changes only when
``|median - old| / old > tolerance / 3`` (the tolerance of that value's family, see
:mod:`harness.baselines.perf`), so noise well inside the gate's own slack does not churn the
baseline; a changed value is rounded to 4 significant figures.

Nothing loosens silently: a proposal that loosens a bound (a lower clip/ssim/psnr, a higher
mean_abs_diff, a higher expected time) is refused by :func:`apply_proposals`,
:func:`apply_perf_proposals` and :func:`merge_into_overlay` unless ``allow_loosen`` is given, and
the refusal lists every offending value.

Results documents (written by the gate, read by :func:`load_results`)::

    {
      "platform": "h100",                        # optional: which overlay the run belongs to
      "cases": {
        "<case_id>": {"kind": "image" | "video", "passed": true,
                      "metrics": {"clip": 0.991 | null, "ssim": ..., "psnr": 31.2 | "inf" | null,
                                  "mean_abs_diff": ...}}          # null = skipped, ignored here
      },
      "perf": {"<scenario_id>": <measured dict, same shape as a perf scenario>}   # optional
    }

All four metric keys are required (null when skipped) so a gate that forgot one is caught.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines.jsonio import expect_number, expect_object, expect_str, join_key, read_json
from harness.baselines.perf import (
    PerfBaselines,
    Tolerances,
    scenario_values,
    set_scenario_values,
    tolerance_category,
    validate_scenario,
)
from harness.baselines.thresholds import HIGHER_IS_BETTER, KINDS, METRICS, ThresholdSet
from harness.case_files import read_toml
from harness.errors import ConfigError
from harness.metrics import metric_from_json

__all__ = [
    "Rule",
    "Policy",
    "DEFAULT_POLICY",
    "load_policy",
    "Proposal",
    "PerfProposal",
    "LooseningRefused",
    "parse_results",
    "load_results",
    "propose_thresholds",
    "apply_proposals",
    "merge_into_overlay",
    "propose_perf",
    "apply_perf_proposals",
    "PROPOSAL_HEADER",
    "proposal_rows",
    "PERF_PROPOSAL_HEADER",
    "perf_proposal_rows",
]

_DECIMALS = 4
_PERF_SIGNIFICANT = 4


# ----------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class Rule:
    """``margin`` away from the worst value, bounded by ``bound``: a cap for lower-bound metrics
    (clip, ssim, psnr), a floor for mean_abs_diff."""

    margin: float
    bound: float


@dataclass(frozen=True)
class Policy:
    """One rule per metric."""

    clip: Rule
    ssim: Rule
    psnr: Rule
    mean_abs_diff: Rule

    def rule(self, metric: str) -> Rule:
        """Rule by metric name."""
        if metric not in METRICS:
            raise KeyError(f"unknown metric {metric!r}; valid: {list(METRICS)}")
        rule: Rule = getattr(self, metric)
        return rule

    def threshold(self, metric: str, worst: float) -> float:
        """The bound this policy derives from the worst observed value (safe-side rounded)."""
        rule = self.rule(metric)
        scale = 10**_DECIMALS
        if metric in HIGHER_IS_BETTER:
            # inf - margin = inf: the cap applies; below 0 a lower bound means nothing
            raw = max(min(worst - rule.margin, rule.bound), 0.0)
            return math.floor(round(raw * scale, 6)) / scale
        raw = max(worst + rule.margin, rule.bound)
        return math.ceil(round(raw * scale, 6)) / scale


DEFAULT_POLICY = Policy(
    clip=Rule(margin=0.02, bound=0.98),
    ssim=Rule(margin=0.04, bound=0.95),
    psnr=Rule(margin=3.0, bound=30.0),
    mean_abs_diff=Rule(margin=3.0, bound=4.0),
)


def _bound_name(metric: str) -> str:
    return "cap" if metric in HIGHER_IS_BETTER else "floor"


def _read_policy_file(path: Path) -> Any:
    if path.suffix.lower() != ".toml":
        return read_json(path)
    return read_toml(path)


def load_policy(path: str | Path, base: Policy = DEFAULT_POLICY) -> Policy:
    """A policy from a JSON/TOML file; metrics or keys it omits keep ``base``'s values.

    Unknown metrics or keys are errors (a typo like ``[pnsr]`` must not silently keep the default).
    """
    path = Path(path)
    doc = expect_object(_read_policy_file(path), path, "")
    for metric in doc:
        if metric not in METRICS:
            raise ConfigError(f"unknown metric; valid: {list(METRICS)}", path=path, key=metric)
    rules = {}
    for metric in METRICS:
        default = base.rule(metric)
        section = expect_object(doc.get(metric, {}), path, metric)
        bound_name = _bound_name(metric)
        for key in section:
            if key not in ("margin", bound_name):
                raise ConfigError(
                    f"unknown key; valid: ['margin', '{bound_name}']", path=path, key=join_key(metric, key)
                )
        margin = expect_number(section.get("margin", default.margin), path, join_key(metric, "margin"), lo=0.0)
        hi = 1.0 if metric in ("clip", "ssim") else None
        bound = expect_number(section.get(bound_name, default.bound), path, join_key(metric, bound_name), lo=0.0, hi=hi)
        rules[metric] = Rule(margin=margin, bound=bound)
    return Policy(**rules)


# ---------------------------------------------------------------------------------- results


def parse_results(doc: Any, path: str | Path = "<memory>") -> dict[str, Any]:
    """Validate a results document and decode its metrics (``"inf"`` -> ``float('inf')``).

    Idempotent: a parsed document parses to itself. Unknown top-level keys are kept.
    """
    doc = expect_object(doc, path, "")
    out = dict(doc)
    if "platform" in doc:
        expect_str(doc["platform"], path, "platform")
    if "cases" not in doc:
        raise ConfigError("missing required key 'cases'", path=path)
    cases = {}
    for case_id, case in expect_object(doc["cases"], path, "cases").items():
        case_path = join_key("cases", case_id)
        case = expect_object(case, path, case_path)
        for key in ("kind", "passed", "metrics"):
            if key not in case:
                raise ConfigError(f"missing required key '{key}'", path=path, key=case_path)
        if case["kind"] not in KINDS:
            raise ConfigError(f"kind must be one of {list(KINDS)}", path=path, key=join_key(case_path, "kind"))
        if not isinstance(case["passed"], bool):
            raise ConfigError("passed must be true or false", path=path, key=join_key(case_path, "passed"))
        raw_metrics = expect_object(case["metrics"], path, join_key(case_path, "metrics"))
        metrics = {}
        for metric in METRICS:
            key = join_key(join_key(case_path, "metrics"), metric)
            if metric not in raw_metrics:
                raise ConfigError("missing metric (write null when it was skipped)", path=path, key=key)
            metrics[metric] = metric_from_json(raw_metrics[metric], path, key)
        cases[case_id] = {**case, "metrics": metrics}
    out["cases"] = cases
    if "perf" in doc:
        for scenario_id, measured in expect_object(doc["perf"], path, "perf").items():
            validate_scenario(measured, path, join_key("perf", scenario_id))
    return out


def load_results(path: str | Path) -> dict[str, Any]:
    """Read and validate a gate results file; any problem is a ConfigError naming the file."""
    return parse_results(read_json(path), path)


# ------------------------------------------------------------------------------ thresholds


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.6g}"


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
        return f"{self.case_id}.{self.metric}: {_fmt(self.old)} -> {_fmt(self.new)} (worst {_fmt(self.worst)})"


def _case_kinds(results: Sequence[dict[str, Any]]) -> dict[str, str]:
    kinds: dict[str, str] = {}
    for doc in results:
        for case_id, case in doc["cases"].items():
            if kinds.setdefault(case_id, case["kind"]) != case["kind"]:
                raise ConfigError(f"case {case_id!r} is recorded both as {kinds[case_id]} and as {case['kind']}")
    return kinds


def propose_thresholds(
    current: ThresholdSet, results: Sequence[dict[str, Any]], policy: Policy = DEFAULT_POLICY
) -> list[Proposal]:
    """One proposal per (case, metric) observed in ``results`` (parsed documents, see
    :func:`parse_results`); failed runs count too, which is exactly when a proposal loosens."""
    proposals = []
    for case_id, kind in _case_kinds(results).items():
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


class LooseningRefused(ConfigError):
    """Raised instead of loosening a bound without explicit permission."""


def _refuse_loosening(proposals: Iterable[Proposal | PerfProposal], allow_loosen: bool) -> None:
    offending = [p.describe() for p in proposals if p.loosens]
    if offending and not allow_loosen:
        raise LooseningRefused(
            f"refusing to loosen {len(offending)} bound(s) without allow_loosen (--allow-loosen):\n  "
            + "\n  ".join(offending)
        )


def apply_proposals(
    thresholds: ThresholdSet, proposals: Sequence[Proposal], allow_loosen: bool = False
) -> ThresholdSet:
    """``thresholds`` with the changed proposals written into its top-most file (the platform
    overlay when there is one); raises :class:`LooseningRefused` first if any would loosen."""
    _refuse_loosening(proposals, allow_loosen)
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
    _refuse_loosening(proposals, allow_loosen)
    path = Path(overlay_path)
    existing = ThresholdSet.load(path) if path.exists() else ThresholdSet.from_json({"cases": {}}, str(path))
    updated = existing.with_values({(p.case_id, p.metric): p.new for p in proposals if p.changed})
    updated.save(path, backup=path.exists())
    return updated.to_json()


PROPOSAL_HEADER: tuple[str, ...] = ("case", "metric", "old", "worst", "new", "change")


def _change_word(changed: bool, loosens: bool) -> str:
    return "LOOSENS" if loosens else ("tightens" if changed else "unchanged")


def proposal_rows(proposals: Iterable[Proposal]) -> list[tuple[str, ...]]:
    """Table rows (strings) matching :data:`PROPOSAL_HEADER`, for the CLI's diff table."""
    return [
        (p.case_id, p.metric, _fmt(p.old), _fmt(p.worst), _fmt(p.new), _change_word(p.changed, p.loosens))
        for p in proposals
    ]


# ------------------------------------------------------------------------------------- perf


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
        return f"{self.scenario_id}.{self.metric}: {_fmt(self.old)} -> {_fmt(self.new)} (median {_fmt(self.median)})"


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
        old_values = scenario_values(baseline.scenario(scenario_id) or {})
        samples: dict[str, list[float]] = {}
        for run in runs:
            for label, value in scenario_values(run).items():
                samples.setdefault(label, []).append(value)
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


def apply_perf_proposals(
    baseline: PerfBaselines, proposals: Sequence[PerfProposal], allow_loosen: bool = False
) -> PerfBaselines:
    """``baseline`` with the changed values written; :class:`LooseningRefused` if any would
    raise an expected time without ``allow_loosen`` (a slowdown must be accepted explicitly)."""
    _refuse_loosening(proposals, allow_loosen)
    updates: dict[str, dict[str, float]] = {}
    for p in proposals:
        if p.changed:
            updates.setdefault(p.scenario_id, {})[p.metric] = p.new
    for scenario_id, values in updates.items():
        scenario = set_scenario_values(baseline.scenario(scenario_id) or {}, values)
        baseline = baseline.with_scenario(scenario_id, scenario)
    return baseline


PERF_PROPOSAL_HEADER: tuple[str, ...] = ("scenario", "value", "old", "median", "new", "change")


def perf_proposal_rows(proposals: Iterable[PerfProposal]) -> list[tuple[str, ...]]:
    """Table rows (strings) matching :data:`PERF_PROPOSAL_HEADER`."""
    return [
        (p.scenario_id, p.metric, _fmt(p.old), _fmt(p.median), _fmt(p.new),
         "added" if p.old is None else _change_word(p.changed, p.loosens))
        for p in proposals
    ]
