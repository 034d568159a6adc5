"""How an attention contract judges what a target returned: shape and dtype first, then two comparisons.

1. Against the target's own single-rank output, by the case's bound (``bitwise`` where the
   reduction order is unchanged): the parity contract.
2. Against an independent float64 oracle of the same attention (softmax scale, causal, mask,
   GQA, the replicated/varlen layout), by the case's ``oracle`` bound (the FlashAttention rule):
   the single-rank output and this rank's sharded output both. Self-comparison alone lets a
   consistently wrong target pass: zeros, an ignored ``causal`` or mask, a wrong scale or an
   upcast output are the same on one rank and on N. This comparison catches them, and when it
   fails, :func:`harness.contracts.oracles.diagnose` says which of those the output looks like.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.contracts.bounds import Bound, FlashAttentionRule, judge, parse_bound
from harness.contracts.judging import Output, RankOutcome, Role
from harness.contracts.oracles import attention_ref64, diagnose, naive_attention
from harness.contracts.params import Param, ParamError, Params
from harness.contracts.stats import Stats, compare

Tensor = torch.Tensor

ORACLE = Param("oracle", "str", "fa:2", "bound of the comparison with float64 attention: fa[:K[:FLOOR]]")


def oracle_rule(p: Params) -> FlashAttentionRule:
    rule = parse_bound(p.oracle, p.dtype)
    if not isinstance(rule, FlashAttentionRule):
        raise ValueError(f"oracle {p.oracle!r}: the oracle comparison is the FlashAttention rule, fa[:K[:FLOOR]]")
    return rule


def check_oracle(p: Params) -> None:
    """The case's ``oracle`` parses, at config time: a typo must not crash every rank (or pass as an expected failure)."""
    try:
        oracle_rule(p)
    except ValueError as exc:
        raise ParamError("oracle", str(exc)) from None


@dataclass(frozen=True)
class Asked:
    """What the attention was asked to compute, on the whole sequence in single-rank order: the oracle's inputs."""

    q: Tensor
    k: Tensor
    v: Tensor
    causal: bool = False
    mask: Tensor | None = None
    scale: float | None = None

    def oracles(self) -> tuple[Tensor, Tensor]:
        """(float64 attention, the naive low precision attention) of these inputs."""
        args = (self.q, self.k, self.v, self.causal, self.scale, self.mask)
        return attention_ref64(*args), naive_attention(*args)


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
    pick: Callable[[Tensor], Tensor],
    kernel: str,
    *,
    report_single: bool,
) -> RankOutcome:
    """This rank's sharded ``out`` against ``pick(single)`` (the case's ``bound``) and both against the oracle.

    ``single`` is the target's single-rank output of ``asked``; ``pick`` maps a whole-sequence
    tensor to what this rank holds (its shard, its replicated tokens, zero rows for padding).
    ``report_single``: this rank speaks for the single-rank output (every rank computed the same one).
    """
    expected = pick(single)
    single_dtype, single_shape = _unlike(
        single, asked.q.dtype, tuple(asked.q.shape[:3]) + (asked.v.shape[3],), Role.SINGLE_RANK
    )
    out_dtype, out_shape = _unlike(out, asked.q.dtype, tuple(expected.shape), Role.SHARDED)
    problems = single_dtype + single_shape + out_dtype + out_shape
    if single_shape or out_shape:
        return RankOutcome(problems=problems, checks=1, kernel=kernel)
    ref64, naive = asked.oracles()
    stats = compare(out, expected, pick(ref64), pick(naive)) if bound.needs_ref64 else compare(out, expected)
    rule = oracle_rule(p)
    judged = {Output(Role.SHARDED): (out, pick)}
    if report_single:
        judged[Output(Role.SINGLE_RANK)] = (single, lambda t: t)
    oracle: dict[Output, Stats] = {}
    hints: dict[Output, str] = {}
    for output, (tensor, chooser) in judged.items():
        oracle[output] = compare(tensor, chooser(ref64), chooser(ref64), chooser(naive))
        if judge(rule, oracle[output]):
            hint = diagnose(tensor, asked.q, asked.k, asked.v, asked.causal, asked.scale, asked.mask, chooser, rule)
            if hint:
                hints[output] = hint
    return RankOutcome(stats=stats, oracle=oracle, hints=hints, problems=problems, kernel=kernel)
