"""Two results files side by side, as pytest-benchmark's ``compare``: per case and figure the old value,
the new one and the % change, and a threshold past which the comparison fails.

Cases match by (stage, case id); a figure is a number among a record's top-level ``figures``.
``change_pct = (new - old) / |old| · 100``, undefined when ``old`` is 0 or infinite and the values
differ. clip, ssim and psnr are better higher, every other figure better lower. ``METRIC:PCT`` fails
a figure that got worse by more than PCT, or worse with no percentage (bitwise or identical broke).
A figure that became NaN or is gone is worse than any value; a number in one file and something
else in the other is a ConfigError naming file and key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.baselines.thresholds import HIGHER_IS_BETTER
from harness.errors import ConfigError
from harness.results import StageRecord


@dataclass(frozen=True)
class Delta:
    """One figure of one case in both runs (``old``/``new`` None: the case or figure is in one run only)."""

    stage: str
    case_id: str
    metric: str
    old: float | None
    new: float | None

    @property
    def change_pct(self) -> float | None:
        if self.old is None or self.new is None or math.isnan(self.old) or math.isnan(self.new):
            return None
        if self.old == self.new:
            return 0.0
        if self.old == 0 or not math.isfinite(self.old):
            return None
        return (self.new - self.old) / abs(self.old) * 100.0

    @property
    def worse(self) -> bool:
        """Worse by the figure's direction; a figure that is gone or became NaN is worse than anything."""
        if self.old is None:
            return False
        if self.new is None or (math.isnan(self.new) and not math.isnan(self.old)):
            return True
        if math.isnan(self.new) or self.old == self.new:
            return False  # NaN in both runs: unchanged (each file's own status says it failed)
        return self.new < self.old if self.metric in HIGHER_IS_BETTER else self.new > self.old


@dataclass(frozen=True)
class StatusChange:
    stage: str
    case_id: str
    old: str | None  # None: the case is new
    new: str | None  # None: the case is gone


@dataclass(frozen=True)
class Rule:
    """``--fail-on METRIC:PCT``: fail when METRIC got worse by more than PCT percent."""

    metric: str
    pct: float

    @classmethod
    def parse(cls, text: str) -> Rule:
        metric, sep, pct = text.partition(":")
        try:
            value = float(pct.strip().removesuffix("%"))
        except ValueError:
            value = -1.0
        if not sep or not metric or not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"expected METRIC:PCT with PCT a non-negative number (e.g. e2e_ms:10), got {text!r}", key="--fail-on"
            )
        return cls(metric, value)

    def broken_by(self, delta: Delta) -> bool:
        if delta.metric != self.metric or not delta.worse:
            return False
        pct = delta.change_pct
        return pct is None or abs(pct) > self.pct


_NON_FINITE = ("inf", "-inf", "nan")  # how results files spell non-finite floats


def _number(value: Any) -> float | None:
    """A figure's value as a float, or None when it is not a number (a kernel's name, a flag, a table)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value in _NON_FINITE:
        return float(value)
    return None


def figures_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric top-level figures of a record."""
    return {k: n for k, v in (record.get("figures") or {}).items() if (n := _number(v)) is not None}


def _check_types(old: Records, new: Records, key: tuple[str, str]) -> None:
    """A figure that is a number in one run must be a number, null or absent in the other (never ``"small"``)."""
    pairs = [(r, r2) for r, r2 in ((old, new), (new, old)) if key in r.records and key in r2.records]
    for mine, theirs in pairs:
        numeric = figures_of(theirs.records[key].record)
        for metric, value in (mine.records[key].record.get("figures") or {}).items():
            if metric in numeric and value is not None and _number(value) is None:
                raise ConfigError(
                    f"{value!r} is not a number, but {theirs.path} has {metric} = {numeric[metric]!r}",
                    path=mine.path,
                    key=f"{mine.records[key].key}.figures.{metric}",
                )


@dataclass(frozen=True)
class Records:
    """The records of one results file (:func:`harness.results.stage_records`) and where they were read."""

    path: str
    records: Mapping[tuple[str, str], StageRecord]


def compare(base: Records, new: Records) -> tuple[list[Delta], list[StatusChange]]:
    """Every figure of every case in either run (base order, then cases only in the new run), and the status changes."""
    deltas, statuses = [], []
    for key in list(base.records) + [k for k in new.records if k not in base.records]:
        _check_types(base, new, key)
        old_rec, new_rec = base.records.get(key), new.records.get(key)
        old_status = None if old_rec is None else str(old_rec.record.get("status"))
        new_status = None if new_rec is None else str(new_rec.record.get("status"))
        if old_status != new_status:
            statuses.append(StatusChange(*key, old_status, new_status))
        old_figs = figures_of(old_rec.record) if old_rec is not None else {}
        new_figs = figures_of(new_rec.record) if new_rec is not None else {}
        for metric in list(old_figs) + [m for m in new_figs if m not in old_figs]:
            deltas.append(Delta(*key, metric, old_figs.get(metric), new_figs.get(metric)))
    return deltas, statuses


def check_rules(deltas: Sequence[Delta], rules: Sequence[Rule]) -> list[tuple[Rule, Delta]]:
    """The (rule, delta) pairs past their threshold; a rule naming a figure neither run has is a ConfigError."""
    known = {d.metric for d in deltas}
    for rule in rules:
        if rule.metric not in known:
            raise ConfigError(
                f"no figure {rule.metric!r} in either file; figures: {', '.join(sorted(known)) or 'none'}",
                key="--fail-on",
            )
    return [(rule, d) for rule in rules for d in deltas if rule.broken_by(d)]
