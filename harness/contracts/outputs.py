"""How an attention contract judges what a target returned: shape and dtype first, then two comparisons.

1. Against the target's own single-rank output, by the case's bound (``bitwise`` where the reduction order
   is unchanged and the kernel allows it: :mod:`.determinism`; else the kernel's own spread).
2. Against an independent float64 oracle of the same attention (scale, causal, mask, GQA, the layout), by
   the case's ``oracle`` bound, the single-rank and the sharded output both: zeros, an ignored ``causal``
   or mask, a wrong scale or an upcast output agree with themselves on one rank and on N; this catches them
   and :func:`harness.contracts.oracles.diagnose` says which one the output looks like.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from harness.contracts.bounds import Bitwise, Bound, FlashAttentionRule, judge, parse_bound
from harness.contracts.determinism import Runs
from harness.contracts.judging import OUTPUT, Against, Comparison, RankOutcome, Role
from harness.contracts.oracles import Asked, diagnose, take
from harness.contracts.params import Param, ParamError, Params
from harness.contracts.stats import compare, magnitude_floor

Tensor = torch.Tensor

ORACLE = Param("oracle", "str", "fa:2", "bound of the comparison with float64 attention: fa[:K[:FLOOR[:ULPS]]]")


def oracle_rule(p: Params) -> FlashAttentionRule:
    rule = parse_bound(p.oracle, p.dtype)
    if not isinstance(rule, FlashAttentionRule):
        raise ValueError(
            f"oracle {p.oracle!r}: the oracle comparison is the FlashAttention rule, fa[:K[:FLOOR[:ULPS]]]"
        )
    return rule


def check_oracle(p: Params) -> None:
    """The case's ``oracle`` parses, at config time: a typo must not crash every rank (or pass as an expected failure)."""
    try:
        oracle_rule(p)
    except ValueError as exc:
        raise ParamError("oracle", str(exc)) from None


def _unlike(out: Tensor, dtype: torch.dtype, shape: tuple[int, ...], what: Role) -> tuple[list[str], list[str]]:
    """(dtype problems, shape problems) of ``out``: a wrong shape leaves nothing to compare."""
    dtypes = [f"{what} output dtype is {out.dtype}, the input's is {dtype}"] if out.dtype != dtype else []
    shapes = [f"{what} output shape is {tuple(out.shape)}, expected {shape}"] if tuple(out.shape) != shape else []
    return dtypes, shapes


def judge_output(
    bound: Bound,
    p: Params,
    asked: Asked,
    out: Tensor,
    single: Tensor,
    rows: Tensor | None,
    kernel: str,
    runs: Runs | None = None,
) -> RankOutcome:
    """This rank's sharded ``out`` against its rows of ``single`` (the case's ``bound``) and both against the oracle.

    ``single`` is the target's single-rank output of ``asked``; ``rows`` the rows of the whole sequence this
    rank holds, in its order (-1: a padding row of zeros; None: all of them). The oracle computes those rows
    only; each rank judges the single-rank output on its own rows, so the ranks together judge all of it.
    ``runs``: the extra single-rank runs of a bitwise case (:func:`judge_runs`).
    """
    rows = torch.arange(single.shape[1], device=single.device) if rows is None else rows
    expected = take(single, rows)
    single_dtype, single_shape = _unlike(
        single, asked.q.dtype, tuple(asked.q.shape[:3]) + (asked.v.shape[3],), Role.SINGLE_RANK
    )
    out_dtype, out_shape = _unlike(out, asked.q.dtype, tuple(expected.shape), Role.SHARDED)
    problems = single_dtype + single_shape + out_dtype + out_shape
    if single_shape or out_shape:
        return RankOutcome(problems=problems, checks=1, kernel=kernel)
    floor = magnitude_floor(single) if isinstance(bound, Bitwise) else None
    ref64, naive = asked.oracles(rows)
    oracle_args = (ref64, naive) if bound.needs_ref64 else ()
    stats = compare(out, expected, *oracle_args, ulps_above=floor)
    valid = (rows >= 0).nonzero().flatten()
    judged = {
        Role.SHARDED: (out, ref64, naive, rows),
        Role.SINGLE_RANK: (take(single, rows[valid]), ref64[:, valid], naive[:, valid], rows[valid]),
    }
    outcome = RankOutcome([Comparison(Against.REFERENCE, OUTPUT, stats)], problems=problems, kernel=kernel)
    rule = oracle_rule(p)
    for role, (tensor, ref, low, its_rows) in judged.items():
        float64 = compare(tensor, ref, ref, low)
        hint = diagnose(tensor, asked, its_rows, rule) if judge(rule, float64) else None
        outcome.comparisons.append(Comparison(Against.FLOAT64, OUTPUT, float64, role, hint))
    if runs is not None:
        extra = {role: results[0] for role, results in runs.results.items()}
        judge_runs(outcome, None, extra, single, floor, rows[valid], ref64[:, valid], naive[:, valid])
        outcome.unmeasured = runs.unmeasured
    return outcome


def judge_runs(
    outcome: RankOutcome,
    part: str | None,
    runs: Mapping[Role, Tensor],
    first: Tensor,
    floor: float | None,
    rows: Tensor,
    ref64: Tensor,
    naive: Tensor,
) -> None:
    """The extra single-rank runs of a bitwise case (:mod:`.determinism`), each against the first run (its spread
    in ulps: what a bitwise claim falls back on) and, on this rank's ``rows``, against float64 attention: a run
    that is wrong, not reordered, fails there rather than widening the bound."""
    name = part or OUTPUT
    for role, result in runs.items():
        against = Against.REPEAT if role is Role.REPEAT else Against.HEAD_GROUPS
        outcome.comparisons.append(Comparison(against, name, compare(result, first, ulps_above=floor)))
        float64 = compare(take(result, rows), ref64, ref64, naive)
        outcome.comparisons.append(Comparison(Against.FLOAT64, name, float64, role))
