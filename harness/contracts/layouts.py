"""What a sequence-parallel attention case hands the target: its inputs in single-rank order and this rank's share.

One :class:`Layout` per kind of case (sharded, replicated suffix / prefix / K/V prefix, varlen,
masks). The forward contracts (:mod:`.usp`) compare the outputs it leads to, the gradient
contracts (:mod:`.usp_grad`) the gradients of the inputs, through the same row indices: which
rows of a whole-sequence tensor (an output, dq, an upstream gradient) this rank holds.
Every rank generates the same seeded full-length inputs, so every rank can compute the
single-rank reference itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.contracts.oracles import Asked, take
from harness.contracts.params import Params
from harness.contracts.registry import RankContext

Tensor = torch.Tensor
GARBAGE_SEED = 7919  # padding filler seed: a varlen path that reads padding changes the output


@dataclass(frozen=True)
class Layout:
    """One case on one rank.

    ``asked``: the whole sequence in single-rank order (the single-rank call and the oracle's inputs);
    ``local``: this rank's q, k, v; ``q_rows`` / ``kv_rows``: which rows of the whole query-side / K/V-side
    sequence this rank holds, in its order (-1: a padding row, zeros); ``replicated_q`` / ``replicated_kv``:
    where the replicated tokens sit in this rank's tensors (their values and gradients must be the same on
    every rank). The oracle computes only the rows a rank holds.
    """

    asked: Asked
    local: tuple[Tensor, Tensor, Tensor]
    q_rows: Tensor
    kv_rows: Tensor
    degrees: tuple[int, int]
    kwargs: dict[str, Any] = field(default_factory=dict)
    replicated_q: slice | None = None
    replicated_kv: slice | None = None

    @property
    def single_kwargs(self) -> dict[str, Any]:
        return {} if self.asked.mask is None else {"attn_mask": self.asked.mask}

    def pick_q(self, t: Tensor) -> Tensor:
        """A whole-sequence query-side tensor (an output, dq, dO) as this rank holds it."""
        return take(t, self.q_rows)

    def pick_kv(self, t: Tensor) -> Tensor:
        """A whole-sequence K/V-side tensor (dk, dv) as this rank holds it."""
        return take(t, self.kv_rows)


LayoutFn = Callable[[RankContext, Params], Layout]


def qkv(ctx: RankContext, p: Params, q_tokens: int, kv_tokens: int | None = None, seed: int | None = None):
    seed = p.seed if seed is None else seed
    kv_tokens = q_tokens if kv_tokens is None else kv_tokens
    return (
        ctx.randn(p, q_tokens, p.heads, seed),
        ctx.randn(p, kv_tokens, p.kv_heads, seed + 1),
        ctx.randn(p, kv_tokens, p.kv_heads, seed + 2),
    )


def shard(ctx: RankContext, p: Params) -> slice:
    return slice(ctx.rank * p.tokens_per_rank, (ctx.rank + 1) * p.tokens_per_rank)


def _rows(ctx: RankContext, *parts: slice | Tensor) -> Tensor:
    """Row indices of the pieces (ranges, or index tensors) in order, on the rank's device."""
    pieces = [torch.arange(part.start, part.stop) if isinstance(part, slice) else part for part in parts]
    return torch.cat(pieces).to(ctx.device)


def _same(rows: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return take(q, rows), take(k, rows), take(v, rows)


def _layout(ctx: RankContext, p: Params, asked: Asked, rows: Tensor, **options: Any) -> Layout:
    """Query and K/V sides held alike (self attention) at the case's degrees."""
    local = _same(rows, asked.q, asked.k, asked.v)
    return Layout(asked, local, rows, rows, (p.ulysses_degree, p.ring_degree), **options)


def sharded(ctx: RankContext, p: Params) -> Layout:
    """Plain sharded attention at (ulysses_degree, ring_degree)."""
    return _layout(ctx, p, Asked(*qkv(ctx, p, p.tokens), p.causal, scale=p.softmax_scale), _rows(ctx, shard(ctx, p)))


def replicated_suffix(ctx: RankContext, p: Params) -> Layout:
    """sglang: rank r holds [shard r, replicated tail]; the single-rank sequence is [shards..., tail]."""
    total, rep = p.tokens, p.replicated
    tail = slice(p.tokens_per_rank, p.tokens_per_rank + rep)
    rows = _rows(ctx, shard(ctx, p), slice(total, total + rep))
    asked = Asked(*qkv(ctx, p, total + rep), p.causal, scale=p.softmax_scale)
    return _layout(ctx, p, asked, rows, kwargs={"num_replicated_suffix": rep}, replicated_q=tail, replicated_kv=tail)


def replicated_prefix(ctx: RankContext, p: Params) -> Layout:
    """sglang: [replicated head, shard r], against the single-rank sequence in *suffix* order (bounded drift)."""
    total, rep = p.tokens, p.replicated
    head = slice(0, rep)
    rows = _rows(ctx, slice(total, total + rep), shard(ctx, p))
    asked = Asked(*qkv(ctx, p, total + rep), p.causal, scale=p.softmax_scale)
    return _layout(ctx, p, asked, rows, kwargs={"num_replicated_prefix": rep}, replicated_q=head, replicated_kv=head)


def replicated_kv_prefix(ctx: RankContext, p: Params) -> Layout:
    """Cross attention on cached K/V: queries sharded, K/V = [replicated prefix, shard r]."""
    total, rep = p.tokens, p.replicated
    q, k, v = qkv(ctx, p, total, rep + total)
    sl = shard(ctx, p)
    q_rows, kv_rows = _rows(ctx, sl), _rows(ctx, slice(0, rep), slice(rep + sl.start, rep + sl.stop))
    return Layout(
        Asked(q, k, v, scale=p.softmax_scale),
        (take(q, q_rows), take(k, kv_rows), take(v, kv_rows)),
        q_rows,
        kv_rows,
        (p.ulysses_degree, p.ring_degree),
        {"num_replicated_kv_prefix": rep},
        None,
        slice(0, rep),
    )


def varlen(ctx: RankContext, p: Params) -> Layout:
    """Uneven per-rank lengths, padded with garbage: valid tokens as one rank, padding rows zeros."""
    lens, padded = p.seq_lens, p.tokens_per_rank
    q, k, v = qkv(ctx, p, sum(lens))
    start, mine = sum(lens[: ctx.rank]), lens[ctx.rank]
    garbage = qkv(ctx, p, padded - mine, seed=p.seed + GARBAGE_SEED)
    inputs = tuple(torch.cat([t[:, start : start + mine], g * 10], dim=1) for t, g in zip((q, k, v), garbage))
    rows = _rows(ctx, slice(start, start + mine), torch.full((padded - mine,), -1))
    return Layout(
        Asked(q, k, v, p.causal, scale=p.softmax_scale),
        inputs,
        rows,
        rows,
        (p.ulysses_degree, p.ring_degree),
        {"seq_lens": lens},
    )  # type: ignore[arg-type]


def masked(ctx: RankContext, p: Params) -> Layout:
    """A key-padding mask ([B, S_k], sharded like the keys) or a dense [B, H, S, S] mask under SP."""
    total = p.tokens
    q, k, v = qkv(ctx, p, total)
    gen = torch.Generator().manual_seed(p.seed + 3)
    if p.mask == "key_padding":
        full = torch.rand(p.batch, total, generator=gen) > 0.3
        full[:, 0] = True  # every query keeps a key, causal or not: no all-masked row
    else:
        full = torch.rand(p.batch, p.heads, total, total, generator=gen) > 0.4
        full |= torch.eye(total, dtype=torch.bool)
    full = full.to(ctx.device)
    sl = shard(ctx, p)
    mine = full[:, sl] if p.mask == "key_padding" else full
    return _layout(ctx, p, Asked(q, k, v, p.causal, full, p.softmax_scale), _rows(ctx, sl), kwargs={"attn_mask": mine})


def masked_replicated_prefix(ctx: RankContext, p: Params) -> Layout:
    """[replicated prefix, shard r] with the matching slice of a key mask ([B, n + S_local])."""
    total, rep = p.tokens, p.replicated
    q, k, v = qkv(ctx, p, rep + total)
    gen = torch.Generator().manual_seed(p.seed + 3)
    full = torch.rand(p.batch, rep + total, generator=gen) > 0.3
    full[:, 0] = True  # no all-masked row
    full = full.to(ctx.device)
    sl = shard(ctx, p)
    rows = _rows(ctx, slice(0, rep), slice(rep + sl.start, rep + sl.stop))
    head = slice(0, rep)
    asked = Asked(q, k, v, False, full, p.softmax_scale)
    return Layout(
        asked,
        _same(rows, q, k, v),
        rows,
        rows,
        (p.world_size, 1),
        {"attn_mask": full.index_select(1, rows), "num_replicated_prefix": rep},
        head,
        head,
    )
