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
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from harness.contracts import layouts
from harness.contracts.bounds import Bitwise, Bound, parse_bound
from harness.contracts.layouts import LayoutFn, qkv
from harness.contracts.outputs import ORACLE, Asked, check_oracle, judge_output
from harness.contracts.params import NUMERIC, PARALLEL, SHAPE, Param, ParamError, Params, bound_param, degrees
from harness.contracts.registry import Body, Contract, RankContext, register
from harness.contracts.stats import RankOutcome, compare, digest
from harness.targets.base import Unsupported

Tensor = torch.Tensor


def _bound(params: Params) -> Bound:
    return parse_bound(params.bound, params.dtype)


def _all_ranks_alive(world_size: int) -> str | None:
    """A collective after the checks: it completes only if no rank is stuck in (or skipped) another one."""
    flag = torch.ones(1)
    dist.all_reduce(flag)
    return None if int(flag.item()) == world_size else f"all_reduce after the checks gave {flag.item()}, not {world_size}"


def _attention_contract(
    contract_id: str, description: str, body: Body, *, bound: str | Bound | Callable[[Params], str] | None = None,
    extra: tuple[Param, ...] = (), ring: Callable[[Params], int] | int | None = None, requires: tuple[str, ...] = (),
    checks: tuple[Callable[[Params], None], ...] = (), min_world_size: int = 1, timeout_s: float = 120.0,
) -> None:
    """Register a ``usp.*`` contract on the standard parameters (world size, [degrees,] shape, numerics, ``extra``).

    ``bound``: a default for the case's ``bound`` parameter (text, or a function of the parameters
    before it), a fixed Bound, or None (every check holds). A contract with a bound judges outputs,
    so it also takes the ``oracle`` bound (:mod:`.outputs`).
    """
    params = PARALLEL + (degrees(ring) if ring is not None else ()) + SHAPE + NUMERIC + extra
    if bound is not None:
        params += (ORACLE,)
        checks += (check_oracle,)
    judged_by: Callable[[Params], Bound] | None = None
    if isinstance(bound, Bound):
        fixed = bound
        judged_by = lambda p: fixed  # noqa: E731
    elif bound is not None:
        params += (bound_param(bound),)
        judged_by = _bound
    contract = Contract(contract_id, description, params, body, requires=frozenset(requires), checks=checks,
                        min_world_size=min_world_size, timeout_s=timeout_s)
    register(contract if judged_by is None else dataclasses.replace(contract, bound=judged_by))


def bitwise_unless_ring(p: Params) -> str:
    """The default bound of a contract bitwise in single-rank key order: the ring merges blocks in another order."""
    return "bitwise" if p["ring_degree"] == 1 else "fa:2"


def output_parity(layout: LayoutFn, ctx: RankContext, p: Params) -> RankOutcome:
    """This rank's output of the case's layout against the single-rank output (and both against float64).

    A ring case whose backend has no LSE is refused by the target (kind "ring_needs_lse") and
    skipped with its reason; that refusal itself is usp.ring_admission's subject. Replicated
    outputs must be the same on every rank, bit for bit.
    """
    case = layout(ctx, p)
    ref = ctx.attention(p, skip_sequence_parallel=True)(case.asked.q, case.asked.k, case.asked.v, **case.single_kwargs)
    with ctx.parallel(*case.degrees):
        attn = ctx.attention(p)
        out = attn(*case.local, **case.kwargs)
    outcome = judge_output(p, case.asked, out, ref, case.pick_q, attn.kernel, report_single=ctx.rank == 0)
    if case.replicated_q is not None:
        outcome.replicated["output"] = digest(out[:, case.replicated_q])
    return outcome


def _output_contract(contract_id: str, description: str, layout: LayoutFn, **options: Any) -> None:
    _attention_contract(contract_id, description, partial(output_parity, layout), **options)


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
        raise ParamError("ring_degree", "Ulysses-only contract: ring_degree must be 1 (see usp.ring_parity / usp.hybrid_parity)")


ULYSSES = dict(ring=1, checks=(_ring_only,))
RING = dict(ring=lambda p: p["world_size"], checks=(_ring_at_least(2),), min_world_size=2)
HYBRID = dict(ring=2, checks=(_ring_at_least(2), _ulysses_at_least(2)), min_world_size=4)

_output_contract(
    "usp.ulysses_parity",
    "Ulysses SP output equals the single-rank output bitwise (the all-to-all keeps the reduction order)",
    layouts.sharded, bound="bitwise", **ULYSSES,
)
_output_contract(
    "usp.ring_parity",
    "ring attention (partials merged in fp32 through the LSE) within the FlashAttention rule, k=2",
    layouts.sharded, bound="fa:2", **RING,
)
_output_contract(
    "usp.hybrid_parity",
    "Ulysses × ring (e.g. W=4 as 2×2) within the FlashAttention rule, k=2",
    layouts.sharded, bound="fa:2", **HYBRID,
)


# ------------------------------------------------------------------ replicated tokens

REPLICATED = (Param("replicated", "int", 6, "replicated tokens (identical on every rank)"),)


def _replicated_positive(p: Params) -> None:
    if p.replicated < 1:
        raise ParamError("replicated", f"must be >= 1, got {p.replicated}")


def _not_causal(why: str) -> Callable[[Params], None]:
    def check(p: Params) -> None:
        if p.causal:
            raise ParamError("causal", why)

    return check


PREFIX_NOT_CAUSAL = _not_causal("the prefix order changes a causal mask: compare without causal")
KV_PREFIX_NOT_CAUSAL = _not_causal("cross attention on cached K/V is not causal")
SUFFIX = dict(extra=REPLICATED, ring=1, requires=("replicated_suffix",), checks=(_replicated_positive,))
PREFIX = dict(extra=REPLICATED, ring=1, requires=("replicated_prefix",), checks=(_replicated_positive, PREFIX_NOT_CAUSAL))
KV_PREFIX = dict(extra=REPLICATED, ring=1, requires=("replicated_kv_prefix",), checks=(_replicated_positive, KV_PREFIX_NOT_CAUSAL))

_output_contract(
    "usp.replicated_suffix_bitwise",
    "replicated suffix kept at the tail (order-preserving): shard and suffix outputs torch.equal to one rank, the "
    "suffix the same on every rank (under ring: the FlashAttention rule, the replicated queries' partials merged in "
    "rank order)",
    layouts.replicated_suffix, bound=bitwise_unless_ring, **SUFFIX,
)
_output_contract(
    "usp.replicated_prefix_drift",
    "replicated prefix path against the single-rank output computed in suffix order: max abs <= 1e-2, the prefix "
    "the same on every rank (also under ring)",
    layouts.replicated_prefix, bound="abs:1e-2", **PREFIX,
)
_output_contract(
    "usp.replicated_kv_prefix",
    "cross attention on a replicated K/V prefix (queries sharded) equals one rank bitwise (under ring: the "
    "FlashAttention rule, the K/V prefix one more block merged through the LSE)",
    layouts.replicated_kv_prefix, bound=bitwise_unless_ring, **KV_PREFIX,
)


# ------------------------------------------------------------------ varlen and masks


def _check_seq_lens(p: Params) -> None:
    if p.seq_lens is None:  # default: each rank a quarter shorter than the previous one
        step = max(1, p.tokens_per_rank // 4)
        p["seq_lens"] = [max(1, p.tokens_per_rank - r * step) for r in range(p.world_size)]
    lens = p.seq_lens
    if len(lens) != p.world_size:
        raise ParamError("seq_lens", f"needs one length per rank ({p.world_size}), got {len(lens)}")
    if any(n < 0 or n > p.tokens_per_rank for n in lens) or sum(lens) == 0:
        raise ParamError("seq_lens", f"{lens}: each must be in [0, tokens_per_rank={p.tokens_per_rank}], not all 0")


MASK_KINDS = ("key_padding", "dense")


def _check_mask_kind(p: Params) -> None:
    if p.mask not in MASK_KINDS:
        raise ParamError("mask", f"unknown mask kind {p.mask!r}; valid: {', '.join(MASK_KINDS)}")


VARLEN = dict(extra=(Param("seq_lens", "int_list", None, "valid tokens per rank (<= tokens_per_rank)"),),
              requires=("varlen",), checks=(_check_seq_lens,))
MASKED = dict(ring=1, extra=(Param("mask", "str", "key_padding", "key_padding or dense"),), requires=("mask",),
              checks=(_check_mask_kind,))

_output_contract(
    "usp.varlen_parity",
    "seq_lens varlen (uneven per-rank lengths): valid tokens equal one rank bitwise, padding rows are zeros",
    layouts.varlen, bound="bitwise", **VARLEN,
)
_output_contract(
    "usp.masked_parity",
    "attention mask under SP (key padding gathered, dense mask head-sliced) equals one rank bitwise "
    "(under ring: within the FlashAttention rule, bound fa:2)",
    layouts.masked, bound=bitwise_unless_ring, **MASKED,
)


# ------------------------------------------------------------------ guards (a mask with replicated tokens: usp_masked_replicated.py)

def ring_admission(ctx: RankContext, p: Params) -> RankOutcome:
    """ring > 1 with a backend lacking the LSE: refused at construction (kind ring_needs_lse), unless skip_sequence_parallel."""
    problems: list[str] = []
    extra: dict[str, Any] = {}
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        try:
            ctx.attention(p, backend=p.no_lse_backend)
            problems.append(f"{p.no_lse_backend} was admitted under ring degree {p.ring_degree}")
        except Unsupported as exc:
            if exc.kind != "ring_needs_lse":
                raise  # e.g. the backend is not installed here: the case cannot run
            extra["refusal"] = exc.reason
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{p.no_lse_backend}: {type(exc).__name__} instead of a ring_needs_lse refusal: {exc}")
        for label, changes in (
            (f"{p.no_lse_backend} with skip_sequence_parallel=True", {"backend": p.no_lse_backend, "skip_sequence_parallel": True}),
            (f"control backend {p.backend or '(default)'}", {}),
        ):
            try:
                ctx.attention(p, **changes)
            except Unsupported as exc:
                if not changes and exc.kind == "ring_needs_lse":  # nothing here can rotate: no control, no case
                    raise Unsupported(f"no ring-capable backend to serve as the control: {exc.reason}", exc.kind) from exc
                problems.append(f"{label} was refused: {exc.kind}: {exc.reason}")
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{label} was refused: {type(exc).__name__}: {exc}")
        problem = _all_ranks_alive(p.world_size)
    return RankOutcome(problems=problems + ([problem] if problem else []), checks=4, extra=extra)


_attention_contract(
    "usp.ring_admission",
    "ring degree > 1 with a backend that returns no LSE is refused at construction (ring_needs_lse), "
    "admitted with skip_sequence_parallel=True; a ring-capable control backend is admitted",
    ring_admission, ring=lambda p: p["world_size"],
    extra=(Param("no_lse_backend", "str", "sage_attn", "a backend whose supports_ring_rotation() is False"),),
    requires=("ring", "backend_choice"), checks=(_ring_at_least(2),), min_world_size=2,
)


def skip_sequence_parallel_local(ctx: RankContext, p: Params) -> RankOutcome:
    """skip_sequence_parallel=True under SP: rank-local, no collective, equal to local attention on own data.

    Ranks hold different data of different lengths and call the layer a different number of
    times: any hidden collective would mismatch or hang, and the final all_reduce would not complete.
    """
    tokens = p.tokens_per_rank + 3 * ctx.rank
    q, k, v = qkv(ctx, p, tokens, seed=p.seed + 1000 * (ctx.rank + 1))
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v)
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        attn = ctx.attention(p, skip_sequence_parallel=True)
        outcome = judge_output(p, Asked(q, k, v, p.causal), attn(q, k, v), ref, lambda t: t, attn.kernel, report_single=True)
        for _ in range(ctx.rank):
            assert outcome.stats is not None
            outcome.stats = outcome.stats.merge(compare(attn(q, k, v), ref))
        problem = _all_ranks_alive(p.world_size)
    outcome.problems += [problem] if problem else []
    made = _made(ctx)
    outcome.problems += [f"its calls made {_said(made)}: a rank-local call makes none"] if made else []
    outcome.checks += 1
    return outcome


def _made(ctx: RankContext) -> dict[str, int]:
    """The collectives the layer's calls under SP made on this rank, by kind (none made: empty)."""
    return {kind: n for kind, n in ctx.collectives.items() if kind != "calls" and n}


def _said(made: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(made.items())) or "no collective"


ULYSSES_EXCHANGES = {"all_to_all": 2}


def ulysses_collectives(ctx: RankContext, p: Params) -> RankOutcome:
    """One call of the Ulysses layer makes exactly two all-to-alls and no other collective: Q, K and V stacked
    in one exchange, the output in one, as sglang's USPAttention does. A layer that exchanges Q, K and V one by
    one pays three latencies where one would do; one that gathers K/V instead of exchanging heads moves W times
    the bytes: both compute the same output, so only the count tells."""
    case = layouts.sharded(ctx, p)
    with ctx.parallel(p.ulysses_degree, 1):
        attn = ctx.attention(p)
        attn(*case.local, **case.kwargs)
    made = _made(ctx)
    problems = [] if made == ULYSSES_EXCHANGES else [
        f"one call made {_said(made)}; the Ulysses path makes exactly 2 all_to_all (Q, K and V stacked in one, the "
        "output in one) and no other collective"]
    return RankOutcome(problems=problems, checks=1, kernel=attn.kernel)


_attention_contract(
    "usp.ulysses_collectives",
    "one Ulysses call makes exactly two all-to-alls (Q, K, V stacked in one; the output in one) and no other "
    "collective, counted at the dispatcher",
    ulysses_collectives, ring=1, checks=(_ring_only,), min_world_size=2,
)


_attention_contract(
    "usp.skip_sequence_parallel_local",
    "skip_sequence_parallel=True under an SP group (default Ulysses over W, which every sequence-parallel "
    "target has; ring_degree for ring) constructs, runs rank-locally with no collective and equals local "
    "attention on the rank's own data, bitwise",
    skip_sequence_parallel_local, bound=Bitwise(), ring=1, min_world_size=2,
)
