"""Sequence-parallel attention contracts (``usp.*``), after sglang's parity test (seed 001).

Every rank generates the same seeded full-length inputs, computes the single-rank reference
itself (``skip_sequence_parallel=True``, before sequence parallelism is initialized), then runs
its own shard under SP and compares its slice of the output. Bitwise where the reduction
order is unchanged (Ulysses, the order-preserving suffix, the K/V prefix, varlen and masks
gathered in rank order); the FlashAttention rule with k=2 where the ring changes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from harness.contracts import determinism, layouts
from harness.contracts.bounds import Bound, parse_bound
from harness.contracts.judging import RankOutcome
from harness.contracts.layouts import LayoutFn
from harness.contracts.memory import footprint
from harness.contracts.outputs import ORACLE, check_oracle, judge_output, oracle_rule
from harness.contracts.params import (
    DETERMINISTIC,
    NUMERIC,
    PARALLEL,
    SHAPE,
    Param,
    ParamError,
    Params,
    bound_param,
    degrees,
)
from harness.contracts.registry import Body, Contract, RankContext, register
from harness.contracts.stats import digest
from harness.targets.base import Capability

Tensor = torch.Tensor


def _bound(params: Params) -> Bound:
    return parse_bound(params.bound, params.dtype)


@dataclass(frozen=True)
class Family:
    """What a family of ``usp.*`` contracts shares (Ulysses, ring, hybrid, replicated tokens, varlen, masks): the
    ring degree's default (None: no degree parameters), the parameters it adds, the capabilities it needs, the
    checks on its parameters and the fewest ranks it takes."""

    ring: Callable[[Params], int] | int | None = None
    extra: tuple[Param, ...] = ()
    requires: tuple[Capability, ...] = ()
    checks: tuple[Callable[[Params], None], ...] = ()
    min_world_size: int = 1
    completions: tuple[Callable[[Params], None], ...] = ()

    def adding(
        self,
        *,
        extra: tuple[Param, ...] = (),
        requires: tuple[Capability, ...] = (),
        min_world_size: int | None = None,
    ) -> Family:
        """This family with more parameters and capabilities (and another least world size)."""
        return dataclasses.replace(
            self,
            extra=self.extra + extra,
            requires=self.requires + requires,
            min_world_size=self.min_world_size if min_world_size is None else min_world_size,
        )


def attention_contract(
    contract_id: str,
    description: str,
    body: Body,
    family: Family,
    *,
    bound: str | Bound | Callable[[Params], str] | None = None,
    timeout_s: float = 120.0,
    gradient: bool = False,
) -> Contract:
    """A ``usp.*`` contract on the standard parameters (world size, [degrees,] shape, numerics, the family's).

    ``bound``: a default for the case's ``bound`` parameter (text, or a function of the parameters
    before it), a fixed Bound, or None (every check holds). A contract with a bound judges outputs,
    so it also takes the ``oracle`` bound (:mod:`.outputs`). ``gradient``: its cases also hold the
    gradients (the memory estimate, :mod:`.memory`).
    """
    ring = family.ring
    params = PARALLEL + (degrees(ring) if ring is not None else ()) + SHAPE + NUMERIC + (DETERMINISTIC,) + family.extra
    contract = Contract(
        contract_id,
        description,
        params,
        body,
        requires=frozenset(family.requires),
        checks=family.checks,
        completions=family.completions,
        min_world_size=family.min_world_size,
        timeout_s=timeout_s,
        memory=partial(footprint, gradient=gradient),
    )
    if bound is None:
        return contract
    if isinstance(bound, Bound):
        fixed = bound
        params, judged_by = params + (ORACLE,), lambda p: fixed
    else:
        params, judged_by = params + (ORACLE, bound_param(bound)), _bound
    return dataclasses.replace(
        contract, params=params, checks=family.checks + (check_oracle,), bound=judged_by, oracle=oracle_rule
    )


def bitwise_unless_ring(p: Params) -> str:
    """The default bound of a contract bitwise in single-rank key order: the ring merges blocks in another order."""
    return "bitwise" if p["ring_degree"] == 1 else "fa:2"


def output_parity(layout: LayoutFn, ctx: RankContext, p: Params) -> RankOutcome:
    """This rank's output of the case's layout against the single-rank output (and both against float64).

    A ring case whose backend has no LSE is refused by the target (Refusal.RING_NEEDS_LSE) and
    skipped with its reason; that refusal itself is usp.ring_admission's subject. Replicated
    outputs must be the same on every rank, bit for bit. Under a bitwise bound the single-rank
    output is computed again and in the Ulysses head groups (:mod:`.determinism`).
    """
    case = layout(ctx, p)
    inputs = (case.asked.q, case.asked.k, case.asked.v)

    def compute(attention: Callable[..., Tensor]) -> list[Tensor]:
        return [attention(*inputs, **case.single_kwargs)]

    [ref] = compute(ctx.attention(p, skip_sequence_parallel=True))
    runs = determinism.extra_runs(ctx, p, compute, case.degrees[0], replicated=case.replicated_q is not None)
    with ctx.parallel(*case.degrees):
        attn = ctx.attention(p)
        out = attn(*case.local, **case.kwargs)
    outcome = judge_output(ctx.bound, p, case.asked, out, ref, case.q_rows, attn.kernel, runs)
    if case.replicated_q is not None:
        outcome.replicated["output"] = digest(out[:, case.replicated_q])
    return outcome


def output_contract(
    contract_id: str, description: str, layout: LayoutFn, family: Family, bound: str | Callable[[Params], str]
) -> Contract:
    """A contract comparing the output of ``layout`` under sequence parallelism with one rank's."""
    return attention_contract(contract_id, description, partial(output_parity, layout), family, bound=bound)


# ------------------------------------------------------------------ Ulysses / ring / hybrid


def _ring_at_least(n: int) -> Callable[[Params], None]:
    def check(p: Params) -> None:
        if p.ring_degree < n:
            raise ParamError("ring_degree", f"must be >= {n} for this contract, got {p.ring_degree}")

    return check


def _ulysses_at_least(n: int) -> Callable[[Params], None]:
    def check(p: Params) -> None:
        if p.ulysses_degree < n:
            raise ParamError("ulysses_degree", f"must be >= {n} for this contract, got {p.ulysses_degree}")

    return check


def _ring_only(p: Params) -> None:
    if p.ring_degree != 1:
        raise ParamError(
            "ring_degree", "Ulysses-only contract: ring_degree must be 1 (see usp.ring_parity / usp.hybrid_parity)"
        )


ULYSSES = Family(ring=1, checks=(_ring_only,))
RING = Family(ring=lambda p: p["world_size"], checks=(_ring_at_least(2),), min_world_size=2)
HYBRID = Family(ring=2, checks=(_ring_at_least(2), _ulysses_at_least(2)), min_world_size=4)

register(
    output_contract(
        "usp.ulysses_parity",
        "Ulysses SP output equals the single-rank output bitwise (the all-to-all keeps the reduction order)",
        layouts.sharded,
        ULYSSES,
        bound="bitwise",
    )
)
register(
    output_contract(
        "usp.ring_parity",
        "ring attention (partials merged in fp32 through the LSE) within the FlashAttention rule, k=2",
        layouts.sharded,
        RING,
        bound="fa:2",
    )
)
register(
    output_contract(
        "usp.hybrid_parity",
        "Ulysses × ring (e.g. W=4 as 2×2) within the FlashAttention rule, k=2",
        layouts.sharded,
        HYBRID,
        bound="fa:2",
    )
)


# ------------------------------------------------------------------ replicated tokens

REPLICATED = (Param("replicated", "int", 6, "replicated tokens (identical on every rank)"),)


def replicated_positive(p: Params) -> None:
    if p.replicated < 1:
        raise ParamError("replicated", f"must be >= 1, got {p.replicated}")


def _not_causal(why: str) -> Callable[[Params], None]:
    def check(p: Params) -> None:
        if p.causal:
            raise ParamError("causal", why)

    return check


PREFIX_NOT_CAUSAL = _not_causal("the prefix order changes a causal mask: compare without causal")
KV_PREFIX_NOT_CAUSAL = _not_causal("cross attention on cached K/V is not causal")
SUFFIX = Family(extra=REPLICATED, ring=1, requires=(Capability.REPLICATED_SUFFIX,), checks=(replicated_positive,))
PREFIX = Family(
    extra=REPLICATED, ring=1, requires=(Capability.REPLICATED_PREFIX,), checks=(replicated_positive, PREFIX_NOT_CAUSAL)
)
KV_PREFIX = Family(
    extra=REPLICATED,
    ring=1,
    requires=(Capability.REPLICATED_KV_PREFIX,),
    checks=(replicated_positive, KV_PREFIX_NOT_CAUSAL),
)

register(
    output_contract(
        "usp.replicated_suffix_bitwise",
        "replicated suffix kept at the tail (order-preserving): shard and suffix outputs torch.equal to one rank, the "
        "suffix the same on every rank (under ring: the FlashAttention rule, the replicated queries' partials merged in "
        "rank order)",
        layouts.replicated_suffix,
        SUFFIX,
        bound=bitwise_unless_ring,
    )
)
register(
    output_contract(
        "usp.replicated_prefix_drift",
        "replicated prefix path against the single-rank output computed in suffix order: max abs <= 1e-2, the prefix "
        "the same on every rank (also under ring)",
        layouts.replicated_prefix,
        PREFIX,
        bound="abs:1e-2",
    )
)
register(
    output_contract(
        "usp.replicated_kv_prefix",
        "cross attention on a replicated K/V prefix (queries sharded) equals one rank bitwise (under ring: the "
        "FlashAttention rule, the K/V prefix one more block merged through the LSE)",
        layouts.replicated_kv_prefix,
        KV_PREFIX,
        bound=bitwise_unless_ring,
    )
)


# ------------------------------------------------------------------ varlen and masks


def _default_seq_lens(p: Params) -> None:
    """Unless given, each rank's valid tokens a quarter of tokens_per_rank fewer than the previous rank's."""
    if p.seq_lens is None:
        step = max(1, p.tokens_per_rank // 4)
        p["seq_lens"] = [max(1, p.tokens_per_rank - r * step) for r in range(p.world_size)]


def _check_seq_lens(p: Params) -> None:
    lens = p.seq_lens
    if len(lens) != p.world_size:
        raise ParamError("seq_lens", f"needs one length per rank ({p.world_size}), got {len(lens)}")
    if any(n < 0 or n > p.tokens_per_rank for n in lens) or sum(lens) == 0:
        raise ParamError("seq_lens", f"{lens}: each must be in [0, tokens_per_rank={p.tokens_per_rank}], not all 0")


MASK_KINDS = ("key_padding", "dense")


def _check_mask_kind(p: Params) -> None:
    if p.mask not in MASK_KINDS:
        raise ParamError("mask", f"unknown mask kind {p.mask!r}; valid: {', '.join(MASK_KINDS)}")


VARLEN = Family(
    ring=1,  # a ring degree > 1 asks for varlen under ring: a target refuses it or runs it correctly
    extra=(Param("seq_lens", "int_list", None, "valid tokens per rank (<= tokens_per_rank)"),),
    requires=(Capability.VARLEN,),
    checks=(_check_seq_lens,),
    completions=(_default_seq_lens,),
)
MASKED = Family(
    ring=1,
    extra=(Param("mask", "str", "key_padding", "key_padding or dense"),),
    requires=(Capability.MASK,),
    checks=(_check_mask_kind,),
)

register(
    output_contract(
        "usp.varlen_parity",
        "seq_lens varlen (uneven per-rank lengths): valid tokens equal one rank bitwise, padding rows are zeros",
        layouts.varlen,
        VARLEN,
        bound="bitwise",
    )
)
register(
    output_contract(
        "usp.masked_parity",
        "attention mask under SP (key padding gathered, dense mask head-sliced) equals one rank bitwise "
        "(under ring: within the FlashAttention rule, bound fa:2)",
        layouts.masked,
        MASKED,
        bound=bitwise_unless_ring,
    )
)
register(
    output_contract(
        "usp.masked_replicated_prefix_parity",
        "a [B, n + S_local] key mask with a replicated prefix under SP equals the masked single-rank output bitwise",
        layouts.masked_replicated_prefix,
        Family(
            extra=REPLICATED,
            requires=(Capability.MASK, Capability.REPLICATED_PREFIX, Capability.MASKED_REPLICATED_PREFIX),
            checks=(replicated_positive, PREFIX_NOT_CAUSAL),
        ),
        bound="bitwise",
    )
)
