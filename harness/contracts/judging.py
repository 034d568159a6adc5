"""The one judging path: every rank's :class:`RankOutcome` merged into a status, a reason and the figures.

A contract body returns typed :class:`Comparison` s (the output or a gradient against the single-rank
reference, judged by the case's bound; against float64 attention, judged by the ``oracle`` rule; the
single-rank computation run again and in head groups), the problems of its checks, and figures it reports.
Ranks send sums and maxima, never tensors, so merged figures equal those of one process comparing everything.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from harness.contracts.bounds import (
    HEAD_VARIANT,
    NON_DETERMINISTIC,
    Bitwise,
    Bound,
    FlashAttentionRule,
    JitterBound,
    judge,
)
from harness.contracts.stats import Stats
from harness.results import FAILED, PASSED, SKIPPED, Status
from harness.targets.base import Refused


class Role(StrEnum):
    """Whose output a comparison with float64 attention is of."""

    SHARDED = "sharded"  # this rank's share of the N-rank output
    SINGLE_RANK = "single-rank"  # the target's own one-rank output (every rank computes the same one)
    REPEAT = "single-rank repeat"  # the same computed again (is the kernel deterministic?)
    HEAD_GROUPS = "head-group"  # the same in a Ulysses rank's head groups (is the kernel head-count invariant?)


@dataclass(frozen=True)
class Output:
    """An output compared with float64 attention: the attention output (``part`` None) or a gradient (``dq``)."""

    role: Role
    part: str | None = None

    @property
    def key(self) -> str:
        """Its key in the figures: ``sharded``, ``single-rank dq``."""
        return str(self.role) if self.part is None else f"{self.role} {self.part}"

    @property
    def label(self) -> str:
        """How a reason names it: ``sharded output``, ``single-rank dq``."""
        return f"{self.role} {self.part or 'output'}"


class Against(StrEnum):
    """What a comparison measures a tensor against, and so what judges it."""

    REFERENCE = "reference"  # the target's single-rank output: the case's bound
    FLOAT64 = "float64"  # float64 attention: the oracle rule
    REPEAT = "repeat"  # the single-rank computation's first run: is the kernel deterministic? (:mod:`.determinism`)
    HEAD_GROUPS = "head_groups"  # the same, from all heads: is it head-count invariant?


@dataclass(frozen=True)
class Comparison:
    """One comparison a rank made: of ``name`` (OUTPUT, or a gradient: dq, dk, dv), ``against`` what, its Stats;
    against float64 also whose output it is (``role``) and what it looks like where it misses (``hint``)."""

    against: Against
    name: str
    stats: Stats
    role: Role | None = None
    hint: str | None = None

    @property
    def output(self) -> Output:
        """As the oracle's figures name it (``sharded``, ``single-rank dq``)."""
        assert self.role is not None
        return Output(self.role, None if self.name == OUTPUT else self.name)


@dataclass
class RankOutcome:
    """What one rank reports for one case: comparisons, failed checks, reported figures, or why it could not run."""

    comparisons: list[Comparison] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the checks that failed, in words
    checks: int = 0  # how many checks the body made
    figures: dict[str, Any] = field(default_factory=dict)  # reported as they are (every rank computes the same)
    replicated: dict[str, str] = field(default_factory=dict)  # digests of what every rank must hold alike
    unmeasured: str | None = None  # why a run of :mod:`.determinism` was not made
    peak_memory: dict[str, float] = field(default_factory=dict)  # GiB this rank held at most: device, host
    kernel: str | None = None
    skip: str | None = None
    refused: Refused | None = None  # with ``skip``: the target's refusal, typed


OUTPUT = "output"  # the name of the attention output's comparisons (a gradient's: dq, dk, dv)
CHECKS = "checks"  # what failed when a contract's own checks did (dtype restored, refusals, collectives, ...)
FAILING_NAMES = (OUTPUT, "dq", "dk", "dv", CHECKS)  # what a verdict names in figures["failing"]


@dataclass(frozen=True)
class Verdict:
    status: Status
    reason: str | None
    figures: dict[str, Any]
    kernel: str | None
    bound: str | None = None  # the bound applied, where it is not the case's (a non-deterministic kernel)
    refused: Refused | None = None  # a skip's typed cause


def verdict(bound: Bound, oracle: FlashAttentionRule | None, outcomes: Sequence[RankOutcome]) -> Verdict:
    """Every rank's outcome judged: the case's bound speaks first, then the checks, then the oracle.

    ``oracle``: the case's rule for outputs against float64 attention (None for a contract without one).
    A rank that raised never answers here: the launcher ended the group and the runner reported it.
    """
    kernel = next((o.kernel for o in outcomes if o.kernel), None)
    skipped = _skipped(outcomes, kernel)
    if skipped is not None:
        return skipped
    figures: dict[str, Any] = {}
    reasons: list[str] = []
    spreads, groups = _compared(outcomes, Against.REPEAT), _compared(outcomes, Against.HEAD_GROUPS)
    parts = _compared(outcomes, Against.REFERENCE)
    merged = parts.pop(OUTPUT, None)
    applied = {name: _applied(bound, spreads.get(name), groups.get(name)) for name in (OUTPUT, *parts)}
    failing: set[str] = set()  # what failed, by name (output, dq, dk, dv, checks): an expected failure's scope
    if merged is not None:
        figures.update(_judged_figures(applied[OUTPUT], merged))
        reasons += _named(failing, OUTPUT, _reasons(applied[OUTPUT], merged, None))
    for name, part in parts.items():
        figures[name] = _judged_figures(applied[name], part)
        reasons += _named(failing, name, _reasons(applied[name], part, name))
    if parts:  # the worst of them as the headline (bitwise: all of them; max_abs: the largest)
        worst = functools.reduce(Stats.merge, parts.values()).figures()
        figures.update({k: v for k, v in worst.items() if k in ("bitwise", "max_abs", "mean_abs", "elements")})
    figures.update(_run_figures(outcomes, spreads, groups))
    unclaimable = {name: NON_DETERMINISTIC for name, spread in spreads.items() if _differs(spread)}
    problems = _named(failing, CHECKS, _merge_problems([o.problems for o in outcomes]))
    for name, problem in _not_alike(outcomes, unclaimable).items():
        problems += _named(failing, name, [problem])
    if unclaimable and any(name in o.replicated for o in outcomes for name in unclaimable):
        figures["replicated_alike_not_claimed"] = {
            n: why for n, why in unclaimable.items() if n in outcomes[0].replicated
        }
    if outcomes and outcomes[0].checks:
        figures["checks"] = outcomes[0].checks
        figures["failed_checks"] = len(problems)
    if outcomes:
        figures.update(outcomes[0].figures)
    if oracle is not None and any(c.against is Against.FLOAT64 for o in outcomes for c in o.comparisons):
        oracle_problems, figures["oracle"] = _judge_oracle(bound, oracle, outcomes)
        for output, problem in oracle_problems:
            problems += _named(failing, output.part or OUTPUT, [problem])
    reason = "; ".join(reasons + problems) or None
    if failing:
        figures["failing"] = sorted(failing)
    return Verdict(FAILED if reason else PASSED, reason, figures, kernel, _applied_text(applied, merged, parts))


def _skipped(outcomes: Sequence[RankOutcome], kernel: str | None) -> Verdict | None:
    """A skip every rank agrees on, a failure where they disagree, None where no rank skipped."""
    skips = {o.skip for o in outcomes if o.skip}
    if not skips:
        return None
    if len(skips) == 1 and all(o.skip for o in outcomes):
        return Verdict(SKIPPED, skips.pop(), {}, kernel, refused=outcomes[0].refused)
    return Verdict(FAILED, f"ranks disagree on whether this case can run: {sorted(skips)}", {}, kernel)


def _run_figures(
    outcomes: Sequence[RankOutcome], spreads: dict[str, Stats], groups: dict[str, Stats]
) -> dict[str, Any]:
    """What a verdict reports beside its comparisons: each output's determinism, the ranks' peak memory."""
    figures: dict[str, Any] = {}
    if spreads:
        figures["determinism"] = {name: _determinism(s, groups.get(name), len(outcomes)) for name, s in spreads.items()}
        if outcomes[0].unmeasured:
            figures["determinism"]["unmeasured"] = outcomes[0].unmeasured
    peaks = _merged_max([o.peak_memory for o in outcomes])
    if peaks:
        figures["peak_memory_gib"] = peaks
    return figures


def _applied(bound: Bound, spread: Stats | None, groups: Stats | None) -> Bound:
    """The case's bound, unless it claims bitwise for a kernel that differed from itself: run to run, or a head
    group from all heads (the fallback bound then takes the larger spread and says which)."""
    differed = [(why, s) for why, s in ((NON_DETERMINISTIC, spread), (HEAD_VARIANT, groups)) if _differs(s)]
    if not isinstance(bound, Bitwise) or not differed:
        return bound
    return JitterBound(max(s.max_ulps or 0.0 for _, s in differed), why="; ".join(why for why, _ in differed))


def _differs(spread: Stats | None) -> bool:
    return spread is not None and not spread.bitwise and not (spread.nonfinite or spread.ref_nonfinite)


def _applied_text(applied: Mapping[str, Bound], output: Stats | None, parts: Mapping[str, Stats]) -> str | None:
    """The bound to report where a non-deterministic kernel changed it (which comparisons, if not all)."""
    judged = ([OUTPUT] if output is not None else []) + list(parts)
    jitter = [name for name in judged if isinstance(applied[name], JitterBound)]
    if not jitter:
        return None
    widest = max((applied[name] for name in jitter), key=lambda b: b.allowed_ulps)  # type: ignore[attr-defined]
    which = "" if len(jitter) == len(judged) else f" for {', '.join(jitter)} (the rest bitwise)"
    return widest.describe() + which


def _determinism(spread: Stats, groups: Stats | None, ranks: int) -> dict[str, Any]:
    """How the single-rank computation differed from itself (each rank ran it twice) and, under Ulysses, how its
    run in head groups differed from it."""
    figures: dict[str, Any] = {
        "deterministic": spread.bitwise,
        "differing": spread.mismatched,
        "elements": spread.count,
        "spread_ulps": spread.max_ulps,
        "pairs": ranks,
    }
    if groups is not None:
        figures["head_groups"] = {
            "invariant": groups.bitwise,
            "differing": groups.mismatched,
            "spread_ulps": groups.max_ulps,
        }
    return figures


def _judged_figures(bound: Bound, stats: Stats) -> dict[str, Any]:
    return {**stats.figures(), **bound.figures(stats)}


def _reasons(bound: Bound, stats: Stats, name: str | None) -> list[str]:
    reason = judge(bound, stats)
    return [] if reason is None else [reason if name is None else f"{name}: {reason}"]


def _judge_oracle(
    bound: Bound, rule: FlashAttentionRule, outcomes: Sequence[RankOutcome]
) -> tuple[list[tuple[Output, str]], dict[str, Any]]:
    """Each output's distance to float64 attention, merged over ranks, judged by ``rule``.

    Where the case's own bound is that same rule it has judged the sharded output against float64
    already: that failure is not said twice (only the oracle's hint about it is added)."""
    problems: list[tuple[Output, str]] = []
    figures: dict[str, Any] = {"bound": rule.describe()}
    float64 = [c for o in outcomes for c in o.comparisons if c.against is Against.FLOAT64]
    for output, merged in _merged([{c.output: c.stats} for c in float64]).items():
        figures[output.key] = {
            "err_ref64": merged.err_ref64,
            "naive_err_ref64": merged.naive_err_ref64,
            "allowed": rule.allowed(merged),
        }
        reason = judge(rule, merged)
        if reason:
            hints = "; ".join(sorted({c.hint for c in float64 if c.output == output and c.hint}))
            if output.role is Role.SHARDED and bound == rule:
                problems += [(output, f"{output.label}: {hints}")] if hints else []
            else:
                problems.append(
                    (output, f"{output.label} vs float64 attention: {reason}" + (f" ({hints})" if hints else ""))
                )
    return problems, figures


K = TypeVar("K")


def _merged(per_rank: Sequence[Mapping[K, Stats]]) -> dict[K, Stats]:
    """Each name's Stats merged over the ranks that report it, in first-seen order."""
    merged: dict[K, Stats] = {}
    for named in per_rank:
        for name, stats in named.items():
            merged[name] = merged[name].merge(stats) if name in merged else stats
    return merged


def _compared(outcomes: Sequence[RankOutcome], against: Against) -> dict[str, Stats]:
    """Each name's comparisons ``against`` one thing, merged over the ranks (and within one), first-seen order."""
    return _merged([{c.name: c.stats} for o in outcomes for c in o.comparisons if c.against is against])


def _merged_max(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each key's largest value over the ranks (a rank's peak memory: the most any one rank held)."""
    merged: dict[str, float] = {}
    for values in per_rank:
        for key, value in values.items():
            merged[key] = max(merged.get(key, value), value)
    return merged


def _named(failing: set[str], name: str, problems: list[str]) -> list[str]:
    """``problems`` as they are, ``name`` noted among what failed if there is one."""
    if problems:
        failing.add(name)
    return problems


def _not_alike(outcomes: Sequence[RankOutcome], unclaimable: Mapping[str, str]) -> dict[str, str]:
    """What every rank must hold alike (replicated outputs and gradients), compared by digest; not those a kernel
    measured non-deterministic at this shape computes (``unclaimable``): ranks that compute their own copy may
    differ by its jitter, and each copy is judged by the case's bound (a jitter bound for a bitwise one) and
    against float64 instead."""
    problems = {}
    for name in dict.fromkeys(n for o in outcomes for n in o.replicated if n not in unclaimable):
        differ = [rank for rank, o in enumerate(outcomes) if o.replicated.get(name) != outcomes[0].replicated.get(name)]
        if differ:
            problems[name] = (
                f"the replicated {name} is not the same on every rank: rank{'s' if len(differ) > 1 else ''} "
                f"{', '.join(map(str, differ))} differ{'' if len(differ) > 1 else 's'} from rank 0"
            )
    return problems


def _merge_problems(per_rank: Sequence[Sequence[str]]) -> list[str]:
    """A problem every rank reports is said once; others are attributed to their rank."""
    if not per_rank:
        return []
    everyone = set(per_rank[0]).intersection(*per_rank[1:])
    merged = [f"every rank: {p}" if len(per_rank) > 1 else p for p in per_rank[0] if p in everyone]
    for rank, problems in enumerate(per_rank):
        merged += [f"rank {rank}: {p}" for p in problems if p not in everyone]
    return merged
