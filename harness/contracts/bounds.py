"""Bounds a contract applies: ``bitwise`` (``torch.equal`` with one rank), ``abs:X`` (``max|out − ref| ≤ X``,
sglang's prefix drift X = 1e-2) and ``fa:K:FLOOR:ULPS``, FlashAttention's test rule ``max|out − ref64| ≤
K·max|naive_lowprec − ref64| + FLOOR + ULPS·ulp_fp32(max|ref64|)``: at most K times the naive low precision
error, plus a floor that scales with the values (fused kernels accumulate in fp32). A bitwise claim on a
kernel measured non-deterministic at the case's shape becomes :class:`JitterBound`.

A NaN or Inf in an output (or in its reference) fails under every bound. The oracles live in
:mod:`harness.contracts.oracles`; docs/judging.md says how contracts apply these bounds.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from harness.contracts.stats import Stats

BOUND_SYNTAX = "'bitwise', 'abs:X' or 'fa[:K[:FLOOR[:ULPS]]]'"
#: fp32 ulps at the reference's largest magnitude that the FlashAttention rule allows besides K times the naive
#: error: torch SDPA's fp32 backward on an H200 (efficient kernel) was 9 of them from float64 (dk of
#: masked_grad_w4), 3.9 times the naive fp32 autograd's error; flash-attn's tests add the rounding of their
#: fp32 reference at the values' size for the same reason.
DEFAULT_ULPS = 16.0


class Bound(ABC):
    needs_ref64: bool = False

    @abstractmethod
    def describe(self) -> str:
        """The bound as a report prints it."""

    @abstractmethod
    def violation(self, stats: Stats) -> str | None:
        """Why ``stats`` break the bound, or None when they hold (non-finite values are judged before)."""

    def figures(self, stats: Stats) -> dict[str, float]:
        """What the bound allowed ``stats``, where it depends on them (a report shows it beside the distance)."""
        return {}


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
    ulps: float = DEFAULT_ULPS
    needs_ref64 = True

    def describe(self) -> str:
        scaled = f" + {self.ulps:g}·ulp_fp32(max|ref64|)" if self.ulps else ""
        return f"max|out − ref64| ≤ {self.k:g}·max|naive_{self.dtype} − ref64| + {self.floor:g}{scaled}"

    def allowed(self, stats: Stats) -> float:
        if stats.naive_err_ref64 is None:
            raise ValueError("the FlashAttention rule needs the ref64 and naive figures")
        return self.k * stats.naive_err_ref64 + self.floor + self.ulps * fp32_ulp(stats.ref64_max or 0.0)

    def figures(self, stats: Stats) -> dict[str, float]:
        return {} if stats.naive_err_ref64 is None else {"allowed": self.allowed(stats)}

    def violation(self, stats: Stats) -> str | None:
        allowed = self.allowed(stats)
        assert stats.err_ref64 is not None
        if stats.err_ref64 <= allowed:
            return None
        return (
            f"max|out − ref64| = {stats.err_ref64:.3e} > {self.k:g}·{stats.naive_err_ref64:.3e} + "
            f"{self.floor:g} + {self.ulps:g}·{fp32_ulp(stats.ref64_max or 0.0):.3g} = {allowed:.3e}"
        )


def fp32_ulp(magnitude: float) -> float:
    """The spacing of float32 numbers at ``magnitude`` (its binade's), 0 for 0."""
    if not magnitude > 0 or not math.isfinite(magnitude):
        return 0.0
    return math.ldexp(torch.finfo(torch.float32).eps, math.frexp(magnitude)[1] - 1)


NON_DETERMINISTIC = "kernel non-deterministic at this shape: bitwise not claimable"
HEAD_VARIANT = (
    "kernel not head-count invariant at this shape (a rank's head group differs from all heads at once): "
    "bitwise not claimable"
)


@dataclass(frozen=True)
class JitterBound(Bound):
    """A bitwise claim on a kernel that differs from itself (run to run, or a head group from all heads): the
    output may differ from the single-rank reference by ``factor`` times that spread, in ulps (at least one).
    ``why`` says which.

    A real defect of the sharded path still fails: a wrong rank order or a scaled rank is hundreds of ulps
    away, while atomics reordered by the scheduler move the last bit or two.
    """

    spread_ulps: float
    factor: float = 2.0
    why: str = NON_DETERMINISTIC

    @property
    def allowed_ulps(self) -> float:
        return self.factor * max(1.0, self.spread_ulps)

    def describe(self) -> str:
        return (
            f"{self.why}; max|out − ref| ≤ {self.allowed_ulps:g} ulp ({self.factor:g}× the kernel's own "
            f"spread of {self.spread_ulps:g} ulp)"
        )

    def violation(self, stats: Stats) -> str | None:
        if stats.max_ulps is None:
            raise ValueError("the jitter bound needs the distance in ulps")
        if stats.max_ulps <= self.allowed_ulps:
            return None
        return (
            f"{stats.max_ulps:.3g} ulp (max abs {stats.max_abs:.3e}) from the single-rank reference > "
            f"{self.allowed_ulps:g} ulp, {self.factor:g}× the kernel's own spread ({self.why})"
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
    violation = bound.violation(stats)
    if violation is None or stats.where is None:
        return violation
    return f"{violation} [{stats.where.describe()}]"


def parse_bound(text: str, dtype: str) -> Bound:
    """``bitwise``, ``abs:X`` or ``fa[:K[:FLOOR[:ULPS]]]`` (a ValueError names the syntax)."""
    kind, *args = [part.strip() for part in text.strip().split(":")]
    try:
        if kind == "bitwise" and not args:
            return Bitwise()
        if kind == "abs" and len(args) == 1:
            return AbsBound(_non_negative(args[0]))
        if kind == "fa" and len(args) <= 3:
            k, floor, ulps = (_non_negative(a) for a in args + ["2", "1e-6", str(DEFAULT_ULPS)][len(args) :])
            return FlashAttentionRule(k, floor, dtype, ulps)
    except ValueError as exc:
        raise ValueError(f"bound {text!r}: {exc}; expected {BOUND_SYNTAX}") from None
    raise ValueError(f"bound {text!r} is not one of {BOUND_SYNTAX}")


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number >= 0")
    return value
