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
from typing import Any

import torch
import torch.distributed as dist

from harness.contracts.bounds import Bitwise, Bound, parse_bound
from harness.contracts.outputs import ORACLE, Asked, check_oracle, judge_output
from harness.contracts.params import NUMERIC, PARALLEL, SHAPE, Param, ParamError, Params, bound_param, degrees
from harness.contracts.registry import Body, Contract, RankContext, register
from harness.contracts.stats import RankOutcome, compare
from harness.targets.base import Unsupported

Tensor = torch.Tensor
_GARBAGE_SEED = 7919  # padding filler seed: a varlen path that reads padding changes the output


def _bound(params: Params) -> Bound:
    return parse_bound(params.bound, params.dtype)


def _qkv(ctx: RankContext, p: Params, q_tokens: int, kv_tokens: int | None = None, seed: int | None = None):
    seed = p.seed if seed is None else seed
    kv_tokens = q_tokens if kv_tokens is None else kv_tokens
    return (
        ctx.randn(p, q_tokens, p.heads, seed),
        ctx.randn(p, kv_tokens, p.kv_heads, seed + 1),
        ctx.randn(p, kv_tokens, p.kv_heads, seed + 2),
    )


def _shard(ctx: RankContext, p: Params) -> slice:
    return slice(ctx.rank * p.tokens_per_rank, (ctx.rank + 1) * p.tokens_per_rank)


def _all_ranks_alive(world_size: int) -> str | None:
    """A collective after the checks: it completes only if no rank is stuck in (or skipped) another one."""
    flag = torch.ones(1)
    dist.all_reduce(flag)
    return None if int(flag.item()) == world_size else f"all_reduce after the checks gave {flag.item()}, not {world_size}"


def _attention_contract(
    contract_id: str, description: str, body: Body, *, bound: str | Bound | None = None, extra: tuple[Param, ...] = (),
    ring: Callable[[Params], int] | int | None = None, requires: tuple[str, ...] = (),
    checks: tuple[Callable[[Params], None], ...] = (), min_world_size: int = 1, timeout_s: float = 120.0,
) -> None:
    """Register a ``usp.*`` contract on the standard parameters (world size, [degrees,] shape, numerics, ``extra``).

    ``bound``: a default for the case's ``bound`` parameter (text), a fixed Bound, or None (every check holds).
    A contract with a bound judges outputs, so it also takes the ``oracle`` bound (:mod:`.outputs`).
    """
    params = PARALLEL + (degrees(ring) if ring is not None else ()) + SHAPE + NUMERIC + extra
    if bound is not None:
        params += (ORACLE,)
        checks += (check_oracle,)
    judged_by: Callable[[Params], Bound] | None = None
    if isinstance(bound, str):
        params += (bound_param(bound),)
        judged_by = _bound
    elif isinstance(bound, Bound):
        fixed = bound
        judged_by = lambda p: fixed  # noqa: E731
    contract = Contract(contract_id, description, params, body, requires=frozenset(requires), checks=checks,
                        min_world_size=min_world_size, timeout_s=timeout_s)
    register(contract if judged_by is None else dataclasses.replace(contract, bound=judged_by))


# ------------------------------------------------------------------ Ulysses / ring / hybrid


def sharded_parity(ctx: RankContext, p: Params) -> RankOutcome:
    """Plain sharded attention at (ulysses_degree, ring_degree) against the single-rank output."""
    q, k, v = _qkv(ctx, p, p.tokens)
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v)
    sl = _shard(ctx, p)
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        # A backend without the LSE cannot rotate: the target refuses (kind "ring_needs_lse"), the
        # case is skipped with its reason; that refusal itself is usp.ring_admission's subject.
        attn = ctx.attention(p)
        out = attn(q[:, sl], k[:, sl], v[:, sl])
    return judge_output(p, Asked(q, k, v, p.causal), out, ref, lambda t: t[:, sl], attn.kernel, report_single=ctx.rank == 0)


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


_attention_contract(
    "usp.ulysses_parity",
    "Ulysses SP output equals the single-rank output bitwise (the all-to-all keeps the reduction order)",
    sharded_parity, bound="bitwise", ring=1, checks=(_ring_only,),
)
_attention_contract(
    "usp.ring_parity",
    "ring attention (partials merged in fp32 through the LSE) within the FlashAttention rule, k=2",
    sharded_parity, bound="fa:2", ring=lambda p: p["world_size"], checks=(_ring_at_least(2),), min_world_size=2,
)
_attention_contract(
    "usp.hybrid_parity",
    "Ulysses × ring (e.g. W=4 as 2×2) within the FlashAttention rule, k=2",
    sharded_parity, bound="fa:2", ring=2, checks=(_ring_at_least(2), _ulysses_at_least(2)), min_world_size=4,
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


def replicated_suffix(ctx: RankContext, p: Params) -> RankOutcome:
    """sglang: rank r holds [shard r, replicated tail]; the output must equal the single-rank one on both."""
    total, rep = p.tokens, p.replicated
    q, k, v = _qkv(ctx, p, total + rep)
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v)
    sl = _shard(ctx, p)
    pick = lambda t: torch.cat([t[:, sl], t[:, total:]], dim=1)  # noqa: E731
    with ctx.parallel(p.world_size, 1):
        attn = ctx.attention(p)
        out = attn(pick(q), pick(k), pick(v), num_replicated_suffix=rep)
    return judge_output(p, Asked(q, k, v, p.causal), out, ref, pick, attn.kernel, report_single=ctx.rank == 0)


def replicated_prefix(ctx: RankContext, p: Params) -> RankOutcome:
    """sglang: [replicated head, shard r] against the reference computed in *suffix* order (bounded drift)."""
    total, rep = p.tokens, p.replicated
    q, k, v = _qkv(ctx, p, total + rep)
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v)
    sl = _shard(ctx, p)
    pick = lambda t: torch.cat([t[:, total:], t[:, sl]], dim=1)  # noqa: E731
    with ctx.parallel(p.world_size, 1):
        attn = ctx.attention(p)
        out = attn(pick(q), pick(k), pick(v), num_replicated_prefix=rep)
    return judge_output(p, Asked(q, k, v, p.causal), out, ref, pick, attn.kernel, report_single=ctx.rank == 0)


def replicated_kv_prefix(ctx: RankContext, p: Params) -> RankOutcome:
    """Cross attention on cached K/V: queries sharded, K/V = [replicated prefix, shard r]."""
    total, rep = p.tokens, p.replicated
    q, k, v = _qkv(ctx, p, total, rep + total)
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v)
    sl = _shard(ctx, p)
    kv_pick = lambda t: torch.cat([t[:, :rep], t[:, rep + sl.start : rep + sl.stop]], dim=1)  # noqa: E731
    with ctx.parallel(p.world_size, 1):
        attn = ctx.attention(p)
        out = attn(q[:, sl], kv_pick(k), kv_pick(v), num_replicated_kv_prefix=rep)
    return judge_output(p, Asked(q, k, v), out, ref, lambda t: t[:, sl], attn.kernel, report_single=ctx.rank == 0)


_attention_contract(
    "usp.replicated_suffix_bitwise",
    "replicated suffix kept at the tail (order-preserving): shard and suffix outputs torch.equal to one rank",
    replicated_suffix, bound="bitwise", extra=REPLICATED, requires=("replicated_suffix",), checks=(_replicated_positive,),
)
_attention_contract(
    "usp.replicated_prefix_drift",
    "replicated prefix path against the single-rank output computed in suffix order: max abs <= 1e-2",
    replicated_prefix, bound="abs:1e-2", extra=REPLICATED, requires=("replicated_prefix",),
    checks=(_replicated_positive, _not_causal("the prefix order changes a causal mask: compare without causal")),
)
_attention_contract(
    "usp.replicated_kv_prefix",
    "cross attention on a replicated K/V prefix (queries sharded) equals one rank bitwise",
    replicated_kv_prefix, bound="bitwise", extra=REPLICATED, requires=("replicated_kv_prefix",),
    checks=(_replicated_positive, _not_causal("cross attention on cached K/V is not causal")),
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


def varlen(ctx: RankContext, p: Params) -> RankOutcome:
    """Uneven per-rank lengths, padded with garbage: valid tokens equal one rank, padding rows are zeros."""
    lens, padded = p.seq_lens, p.tokens_per_rank
    q, k, v = _qkv(ctx, p, sum(lens))
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v)
    start, mine = sum(lens[: ctx.rank]), lens[ctx.rank]
    garbage = _qkv(ctx, p, padded - mine, seed=p.seed + _GARBAGE_SEED)
    inputs = [torch.cat([t[:, start : start + mine], g * 10], dim=1) for t, g in zip((q, k, v), garbage)]
    pick = lambda t: torch.cat([t[:, start : start + mine], t.new_zeros(p.batch, padded - mine, *t.shape[2:])], dim=1)  # noqa: E731
    with ctx.parallel(p.world_size, 1):
        attn = ctx.attention(p)
        out = attn(*inputs, seq_lens=lens)
    return judge_output(p, Asked(q, k, v, p.causal), out, ref, pick, attn.kernel, report_single=ctx.rank == 0)


MASK_KINDS = ("key_padding", "dense")


def _check_mask_kind(p: Params) -> None:
    if p.mask not in MASK_KINDS:
        raise ParamError("mask", f"unknown mask kind {p.mask!r}; valid: {', '.join(MASK_KINDS)}")


def masked(ctx: RankContext, p: Params) -> RankOutcome:
    """A key-padding mask ([B, S_k], sharded like the keys) or a dense [B, H, S, S] mask under SP."""
    total = p.tokens
    q, k, v = _qkv(ctx, p, total)
    gen = torch.Generator().manual_seed(p.seed + 3)
    if p.mask == "key_padding":
        full = torch.rand(p.batch, total, generator=gen) > 0.3
        full[:, 0] = True  # every query keeps a key, causal or not: no all-masked row
    else:
        full = torch.rand(p.batch, p.heads, total, total, generator=gen) > 0.4
        full |= torch.eye(total, dtype=torch.bool)
    full = full.to(ctx.device)
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v, attn_mask=full)
    sl = _shard(ctx, p)
    mine = full[:, sl] if p.mask == "key_padding" else full
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        attn = ctx.attention(p)
        out = attn(q[:, sl], k[:, sl], v[:, sl], attn_mask=mine)
    return judge_output(p, Asked(q, k, v, p.causal, full), out, ref, lambda t: t[:, sl], attn.kernel,
                        report_single=ctx.rank == 0)


_attention_contract(
    "usp.varlen_parity",
    "seq_lens varlen (uneven per-rank lengths): valid tokens equal one rank bitwise, padding rows are zeros",
    varlen, bound="bitwise", extra=(Param("seq_lens", "int_list", None, "valid tokens per rank (<= tokens_per_rank)"),),
    requires=("varlen",), checks=(_check_seq_lens,),
)
_attention_contract(
    "usp.masked_parity",
    "attention mask under SP (key padding gathered, dense mask head-sliced) equals one rank bitwise "
    "(under ring: within the FlashAttention rule, bound fa:2)",
    masked, bound="bitwise", ring=1, extra=(Param("mask", "str", "key_padding", "key_padding or dense"),),
    requires=("mask",), checks=(_check_mask_kind,),
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
    q, k, v = _qkv(ctx, p, tokens, seed=p.seed + 1000 * (ctx.rank + 1))
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v)
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        attn = ctx.attention(p, skip_sequence_parallel=True)
        outcome = judge_output(p, Asked(q, k, v, p.causal), attn(q, k, v), ref, lambda t: t, attn.kernel, report_single=True)
        for _ in range(ctx.rank):
            assert outcome.stats is not None
            outcome.stats = outcome.stats.merge(compare(attn(q, k, v), ref))
        problem = _all_ranks_alive(p.world_size)
    outcome.problems += [problem] if problem else []
    return outcome


_attention_contract(
    "usp.skip_sequence_parallel_local",
    "skip_sequence_parallel=True under an SP group (default Ulysses over W, which every sequence-parallel "
    "target has; ring_degree for ring) constructs, runs rank-locally with no collective and equals local "
    "attention on the rank's own data, bitwise",
    skip_sequence_parallel_local, bound=Bitwise(), ring=1, min_world_size=2,
)
