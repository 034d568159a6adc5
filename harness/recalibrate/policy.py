"""Threshold recalibration policy: how far from the worst observed run each metric's new bound sits.

Default (sglang PR #29824), from the worst value over all runs of a case::

    clip = min(worst - 0.02, 0.98)      ssim = min(worst - 0.04, 0.95)
    psnr = min(worst - 3 dB, 30 dB)     mean_abs_diff = max(worst + 3, 4)

The cap and floor keep noise from failing a bound made from identical images (psnr inf); a lower
bound never goes below 0; rounding to 4 decimals goes towards the safe side, so it never fails the
worst run. A policy file (JSON, or TOML by its name) overrides any part: docs/references.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines.thresholds import HIGHER_IS_BETTER, METRIC_RANGES, METRICS
from harness.errors import ConfigError
from harness.files.jsonio import expect_number, expect_object, join_key, read_json
from harness.files.tomlio import read_toml

_DECIMALS = 4


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
        # above the metric's largest possible value an upper bound is already as loose as it gets
        raw = min(max(worst + rule.margin, rule.bound), METRIC_RANGES[metric][1])
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
        lo, hi = METRIC_RANGES[metric]  # a margin wider than the metric's range, or a bound outside it, means nothing
        margin = expect_number(
            section.get("margin", default.margin), path, join_key(metric, "margin"), lo=0.0, hi=hi - lo
        )
        bound = expect_number(section.get(bound_name, default.bound), path, join_key(metric, bound_name), lo=0.0, hi=hi)
        rules[metric] = Rule(margin=margin, bound=bound)
    return Policy(**rules)
