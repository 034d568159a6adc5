"""Sequence-parallel attention contracts (``usp.*``), after sglang's parity test (seed 001).

Every rank generates the same seeded full-length inputs, computes the single-rank reference
itself (``skip_sequence_parallel=True``, before sequence parallelism is initialized), then runs
its own shard under SP and compares its slice of the output. Bitwise where the reduction
order is unchanged (Ulysses, the order-preserving suffix, the K/V prefix, varlen and masks
gathered in rank order); the FlashAttention rule with k=2 where the ring changes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harness.contracts.bounds import Bitwise, Bound, attention_ref64, naive_attention, parse_bound
from harness.contracts.params import NUMERIC, PARALLEL, SHAPE, Param, ParamError, Params, bound_param, degrees
from harness.contracts.registry import Contract, RankContext, register
from harness.contracts.verdict import RankOutcome, Stats, compare
from harness.targets.base import Unsupported
from reference_impl.attention.layer import RingAdmissionError  # the reference refusal; other targets raise Unsupported

Tensor = torch.Tensor
_GARBAGE_SEED = 7919  # padding filler seed: a varlen path that reads padding changes the output


def _bound(params: Params) -> Bound:
    return parse_bound(params.bound, params.dtype)


def _oracles(bound: Bound, q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None = None):
    """ref64 and the naive low precision output, only when the bound needs them."""
    if not bound.needs_ref64:
        return None
    return attention_ref64(q, k, v, causal, None, mask), naive_attention(q, k, v, causal, None, mask)


def _compare(out: Tensor, expected: Tensor, oracles: tuple[Tensor, Tensor] | None, pick: Callable[[Tensor], Tensor]) -> Stats:
    if oracles is None:
        return compare(out, expected)
    return compare(out, expected, pick(oracles[0]), pick(oracles[1]))


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


# ------------------------------------------------------------------ Ulysses / ring / hybrid


def sharded_parity(ctx: RankContext, p: Params) -> RankOutcome:
    """Plain sharded attention at (ulysses_degree, ring_degree) against the single-rank output."""
    bound = _bound(p)
    q, k, v = _qkv(ctx, p, p.tokens)
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v)
    oracles = _oracles(bound, q, k, v, p.causal)
    sl = _shard(ctx, p)
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        try:
            attn = ctx.attention(p)
        except RingAdmissionError as exc:
            # A backend without the LSE cannot rotate: that refusal is usp.ring_admission's subject;
            # here it means this case cannot be expressed with that backend (the same on every rank).
            raise Unsupported(f"backend {p.get('backend')} returns no log-sum-exp, so it cannot run ring attention") from exc
        out = attn(q[:, sl], k[:, sl], v[:, sl])
    return RankOutcome(stats=_compare(out, ref[:, sl], oracles, lambda t: t[:, sl]), kernel=attn.kernel)


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


register(Contract(
    "usp.ulysses_parity",
    "Ulysses SP output equals the single-rank output bitwise (the all-to-all keeps the reduction order)",
    PARALLEL + degrees(1) + SHAPE + NUMERIC + (bound_param("bitwise"),),
    sharded_parity,
    bound=_bound,
    checks=(_ring_only,),
))
register(Contract(
    "usp.ring_parity",
    "ring attention (partials merged in fp32 through the LSE) within the FlashAttention rule, k=2",
    PARALLEL + degrees(lambda p: p["world_size"]) + SHAPE + NUMERIC + (bound_param("fa:2"),),
    sharded_parity,
    bound=_bound,
    checks=(_ring_at_least(2),),
    min_world_size=2,
))
register(Contract(
    "usp.hybrid_parity",
    "Ulysses × ring (e.g. W=4 as 2×2) within the FlashAttention rule, k=2",
    PARALLEL + degrees(2) + SHAPE + NUMERIC + (bound_param("fa:2"),),
    sharded_parity,
    bound=_bound,
    checks=(_ring_at_least(2), _ulysses_at_least(2)),
    min_world_size=4,
))


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
    bound = _bound(p)
    oracles = _oracles(bound, q, k, v, p.causal)
    with ctx.parallel(p.world_size, 1):
        attn = ctx.attention(p)
        out = attn(pick(q), pick(k), pick(v), num_replicated_suffix=rep)
    return RankOutcome(stats=_compare(out, pick(ref), oracles, pick), kernel=attn.kernel)


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
    return RankOutcome(stats=compare(out, pick(ref)), kernel=attn.kernel)


def replicated_kv_prefix(ctx: RankContext, p: Params) -> RankOutcome:
    """Cross attention on cached K/V: queries sharded, K/V = [replicated prefix, shard r]."""
    total, rep = p.tokens, p.replicated
    q, k, v = _qkv(ctx, p, total, rep + total)
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v)
    sl = _shard(ctx, p)
    kv_pick = lambda t: torch.cat([t[:, :rep], t[:, rep + sl.start : rep + sl.stop]], dim=1)  # noqa: E731
    bound = _bound(p)
    oracles = _oracles(bound, q, k, v, False)
    with ctx.parallel(p.world_size, 1):
        attn = ctx.attention(p)
        out = attn(q[:, sl], kv_pick(k), kv_pick(v), num_replicated_kv_prefix=rep)
    return RankOutcome(stats=_compare(out, ref[:, sl], oracles, lambda t: t[:, sl]), kernel=attn.kernel)


register(Contract(
    "usp.replicated_suffix_bitwise",
    "replicated suffix kept at the tail (order-preserving): shard and suffix outputs torch.equal to one rank",
    PARALLEL + SHAPE + NUMERIC + REPLICATED + (bound_param("bitwise"),),
    replicated_suffix,
    requires=frozenset({"replicated_suffix"}),
    bound=_bound,
    checks=(_replicated_positive,),
))
register(Contract(
    "usp.replicated_prefix_drift",
    "replicated prefix path against the single-rank output computed in suffix order: max abs <= 1e-2",
    PARALLEL + SHAPE + NUMERIC + REPLICATED + (bound_param("abs:1e-2"),),
    replicated_prefix,
    requires=frozenset({"replicated_prefix"}),
    bound=_bound,
    checks=(_replicated_positive, _not_causal("the prefix order changes a causal mask: compare without causal")),
))
register(Contract(
    "usp.replicated_kv_prefix",
    "cross attention on a replicated K/V prefix (queries sharded) equals one rank bitwise",
    PARALLEL + SHAPE + NUMERIC + REPLICATED + (bound_param("bitwise"),),
    replicated_kv_prefix,
    requires=frozenset({"replicated_kv_prefix"}),
    bound=_bound,
    checks=(_replicated_positive, _not_causal("cross attention on cached K/V is not causal")),
))


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
    expected = torch.cat([ref[:, start : start + mine], ref.new_zeros(p.batch, padded - mine, p.heads, p.head_dim)], dim=1)
    with ctx.parallel(p.world_size, 1):
        attn = ctx.attention(p)
        out = attn(*inputs, seq_lens=lens)
    return RankOutcome(stats=compare(out, expected), kernel=attn.kernel)


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
    with ctx.parallel(p.world_size, 1):
        attn = ctx.attention(p)
        out = attn(q[:, sl], k[:, sl], v[:, sl], attn_mask=mine)
    return RankOutcome(stats=compare(out, ref[:, sl]), kernel=attn.kernel)


register(Contract(
    "usp.varlen_parity",
    "seq_lens varlen (uneven per-rank lengths): valid tokens equal one rank bitwise, padding rows are zeros",
    PARALLEL + SHAPE + NUMERIC + (Param("seq_lens", "int_list", None, "valid tokens per rank (<= tokens_per_rank)"), bound_param("bitwise")),
    varlen,
    requires=frozenset({"varlen"}),
    bound=_bound,
    checks=(_check_seq_lens,),
))
register(Contract(
    "usp.masked_parity",
    "attention mask under SP (key padding gathered, dense mask head-sliced) equals one rank bitwise",
    PARALLEL + SHAPE + NUMERIC + (Param("mask", "str", "key_padding", "key_padding or dense"), bound_param("bitwise")),
    masked,
    requires=frozenset({"mask"}),
    bound=_bound,
    checks=(_check_mask_kind,),
))


# ------------------------------------------------------------------ guards

_REPLICATED_KWARGS = {"prefix": "num_replicated_prefix", "suffix": "num_replicated_suffix", "kv_prefix": "num_replicated_kv_prefix"}


def _check_refused(p: Params) -> None:
    unknown = sorted(set(p.refused) - set(_REPLICATED_KWARGS))
    if unknown or not p.refused:
        raise ParamError("refused", f"{p.refused}: a non-empty subset of {', '.join(_REPLICATED_KWARGS)}")


def masked_rejects_replicated(ctx: RankContext, p: Params) -> RankOutcome:
    """mask + replicated tokens under SP: the ``refused`` kinds raise on every rank, the others run; the group still answers.

    A refusal is NotImplementedError or the target's Unsupported of kind ``mask_with_replicated``.
    A prefix left out of ``refused`` (legal in sglang since PR #36735) needs ``masked_replicated_prefix``.
    """
    if "prefix" not in p.refused and "masked_replicated_prefix" not in ctx.target.capabilities():
        raise Unsupported("a masked replicated prefix is expected to run; this target does not declare masked_replicated_prefix")
    q, k, v = _qkv(ctx, p, p.tokens_per_rank + p.replicated)
    mask = torch.ones(p.batch, q.shape[1], dtype=torch.bool, device=ctx.device)
    problems: list[str] = []
    with ctx.parallel(p.world_size, 1):
        attn = ctx.attention(p)
        for kind, kwarg in _REPLICATED_KWARGS.items():
            call, refused = f"attn_mask with {kwarg}={p.replicated}", kind in p.refused
            try:
                out = attn(q, k, v, attn_mask=mask, **{kwarg: p.replicated})
                if refused:
                    problems.append(f"{call} ran instead of raising NotImplementedError")
                elif out.shape != q.shape or not torch.isfinite(out).all():
                    problems.append(f"{call} gave shape {tuple(out.shape)} (expected {tuple(q.shape)}) or non-finite values")
            except (NotImplementedError, Unsupported) as exc:
                if isinstance(exc, Unsupported) and exc.kind != "mask_with_replicated":
                    raise
                if not refused:
                    problems.append(f"{call} was refused, but it is legal here: {exc}")
            except Exception as exc:  # noqa: BLE001 - any other outcome is the finding
                problems.append(f"{call}: {type(exc).__name__} instead of {'a refusal' if refused else 'running'}: {exc}")
        problem = _all_ranks_alive(p.world_size)
    return RankOutcome(problems=problems + ([problem] if problem else []), checks=len(_REPLICATED_KWARGS) + 1, kernel=attn.kernel)


register(Contract(
    "usp.masked_rejects_replicated",
    "attn_mask with replicated tokens under SP: each kind in `refused` raises NotImplementedError on every rank "
    "before any collective, the others run",
    PARALLEL + SHAPE + NUMERIC + REPLICATED
    + (Param("refused", "str_list", list(_REPLICATED_KWARGS), "replicated kinds a mask must be refused with: prefix, suffix, kv_prefix"),),
    masked_rejects_replicated,
    requires=frozenset({"mask", "replicated_prefix", "replicated_suffix", "replicated_kv_prefix"}),
    checks=(_replicated_positive, _check_refused),
    min_world_size=2,
    timeout_s=60.0,
))


def ring_admission(ctx: RankContext, p: Params) -> RankOutcome:
    """ring > 1 with a backend lacking the LSE: RuntimeError at construction, unless skip_sequence_parallel."""
    problems: list[str] = []
    extra: dict[str, Any] = {}
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        try:
            ctx.attention(p, backend=p.no_lse_backend)
            problems.append(f"{p.no_lse_backend} was admitted under ring degree {p.ring_degree}")
        except Unsupported as exc:
            if exc.kind != "ring_needs_lse":
                raise
            extra["refusal"] = exc.reason
        except RuntimeError as exc:
            extra["refusal"] = str(exc)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{p.no_lse_backend}: {type(exc).__name__} instead of RuntimeError: {exc}")
        for label, changes in (
            (f"{p.no_lse_backend} with skip_sequence_parallel=True", {"backend": p.no_lse_backend, "skip_sequence_parallel": True}),
            (f"control backend {p.backend or '(default)'}", {}),
        ):
            try:
                ctx.attention(p, **changes)
            except Unsupported:
                raise  # e.g. no backend here can run ring at all: the case cannot be expressed
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{label} was refused: {type(exc).__name__}: {exc}")
        problem = _all_ranks_alive(p.world_size)
    return RankOutcome(problems=problems + ([problem] if problem else []), checks=4, extra=extra)


register(Contract(
    "usp.ring_admission",
    "ring degree > 1 with a backend that returns no LSE is refused at construction (RuntimeError), "
    "admitted with skip_sequence_parallel=True; a ring-capable control backend is admitted",
    PARALLEL + degrees(lambda p: p["world_size"]) + SHAPE + NUMERIC
    + (Param("no_lse_backend", "str", "sage_attn", "a backend whose supports_ring_rotation() is False"),),
    ring_admission,
    requires=frozenset({"ring", "backend_choice"}),
    checks=(_ring_at_least(2),),
    min_world_size=2,
))


def skip_sequence_parallel_local(ctx: RankContext, p: Params) -> RankOutcome:
    """skip_sequence_parallel=True under SP: rank-local, no collective, equal to local attention on own data.

    Ranks hold different data of different lengths and call the layer a different number of
    times: any hidden collective would mismatch or hang, and the final all_reduce would not complete.
    """
    tokens = p.tokens_per_rank + 3 * ctx.rank
    q, k, v = _qkv(ctx, p, tokens, seed=p.seed + 1000 * (ctx.rank + 1))
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v)
    stats: Stats | None = None
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        attn = ctx.attention(p, skip_sequence_parallel=True)
        for _ in range(ctx.rank + 1):
            s = compare(attn(q, k, v), ref)
            stats = s if stats is None else stats.merge(s)
        problem = _all_ranks_alive(p.world_size)
    return RankOutcome(stats=stats, problems=[problem] if problem else [], kernel=attn.kernel)


register(Contract(
    "usp.skip_sequence_parallel_local",
    "skip_sequence_parallel=True under an SP group (default W=2, ring 2) constructs, runs rank-locally "
    "with no collective and equals local attention on the rank's own data, bitwise",
    PARALLEL + degrees(lambda p: p["world_size"]) + SHAPE + NUMERIC,
    skip_sequence_parallel_local,
    bound=lambda p: Bitwise(),
    min_world_size=2,
))
