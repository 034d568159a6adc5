"""Bounds a contract applies, and the two oracles the FlashAttention rule needs.

- ``bitwise``: ``torch.equal`` with the single-rank reference; holds where the reduction order is unchanged.
- ``abs:X``: ``max|out − ref| ≤ X`` (sglang's replicated-prefix drift, X = 1e-2).
- ``fa:K:FLOOR``: FlashAttention's test rule ``max|out − ref64| ≤ K·max|naive_lowprec − ref64| + FLOOR``
  (ref64: float64 attention; naive_lowprec: softmax(QKᵀ)V in the low precision): at most K times the naive error.

A NaN or Inf in an output (or in its reference) fails under every bound. The oracles live in
:mod:`harness.contracts.oracles`; docs/judging.md says how contracts apply these bounds.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from harness.contracts.stats import Stats

BOUND_SYNTAX = "'bitwise', 'abs:X' or 'fa[:K[:FLOOR]]'"


class Bound(ABC):
    needs_ref64: bool = False

    @abstractmethod
    def describe(self) -> str:
        """The bound as a report prints it."""

    @abstractmethod
    def violation(self, stats: Stats) -> str | None:
        """Why ``stats`` break the bound, or None when they hold (non-finite values are judged before)."""


@dataclass(frozen=True)
class Bitwise(Bound):
    def describe(self) -> str:
        return "bitwise (torch.equal with the single-rank reference)"

    def violation(self, stats: Stats) -> str | None:
        if stats.bitwise:
            return None
        if stats.mismatched is None:
            return f"not bitwise: differs from the single-rank reference (max abs {stats.max_abs:.3e})"
        return (
            f"not bitwise: {stats.mismatched} of {stats.count} elements differ from the single-rank "
            f"reference (max abs {stats.max_abs:.3e})"
        )


@dataclass(frozen=True)
class AbsBound(Bound):
    atol: float

    def describe(self) -> str:
        return f"max|out − ref| ≤ {self.atol:g}"

    def violation(self, stats: Stats) -> str | None:
        if stats.max_abs <= self.atol:
            return None
        return f"max abs {stats.max_abs:.3e} > {self.atol:g}"


@dataclass(frozen=True)
class FlashAttentionRule(Bound):
    k: float = 2.0
    floor: float = 1e-6
    dtype: str = "low precision"
    needs_ref64 = True

    def describe(self) -> str:
        return f"max|out − ref64| ≤ {self.k:g}·max|naive_{self.dtype} − ref64| + {self.floor:g}"

    def allowed(self, stats: Stats) -> float:
        if stats.naive_err_ref64 is None:
            raise ValueError("the FlashAttention rule needs the ref64 and naive figures")
        return self.k * stats.naive_err_ref64 + self.floor

    def violation(self, stats: Stats) -> str | None:
        allowed = self.allowed(stats)
        assert stats.err_ref64 is not None
        if stats.err_ref64 <= allowed:
            return None
        return (
            f"max|out − ref64| = {stats.err_ref64:.3e} > {self.k:g}·{stats.naive_err_ref64:.3e} + "
            f"{self.floor:g} = {allowed:.3e}"
        )


@dataclass(frozen=True)
class AllChecks(Bound):
    """For behavioural contracts (guards, precedence): every check of the contract must hold."""

    def describe(self) -> str:
        return "every check holds"

    def violation(self, stats: Stats) -> str | None:
        return None


def judge(bound: Bound, stats: Stats) -> str | None:
    """The failure reason under ``bound``, NaN/Inf first; None when the bound holds."""
    if stats.nonfinite or stats.ref_nonfinite:
        return f"non-finite values: {stats.nonfinite} in the output, {stats.ref_nonfinite} in the reference"
    if not math.isfinite(stats.max_abs):
        return f"max abs is {stats.max_abs}"
    return bound.violation(stats)


def parse_bound(text: str, dtype: str) -> Bound:
    """``bitwise``, ``abs:X``, ``fa``, ``fa:K`` or ``fa:K:FLOOR`` (a ValueError names the syntax)."""
    kind, *args = [part.strip() for part in text.strip().split(":")]
    try:
        if kind == "bitwise" and not args:
            return Bitwise()
        if kind == "abs" and len(args) == 1:
            return AbsBound(_non_negative(args[0]))
        if kind == "fa" and len(args) <= 2:
            k = _non_negative(args[0]) if args else 2.0
            floor = _non_negative(args[1]) if len(args) > 1 else 1e-6
            return FlashAttentionRule(k, floor, dtype)
    except ValueError as exc:
        raise ValueError(f"bound {text!r}: {exc}; expected {BOUND_SYNTAX}") from None
    raise ValueError(f"bound {text!r} is not one of {BOUND_SYNTAX}")


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number >= 0")
    return value
