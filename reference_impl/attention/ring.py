"""Ring attention: K/V blocks rotate around the ring group, partials merge in fp32 through the LSE.

Each function runs on every ring rank after the Ulysses exchange: sharded tensors hold this rank's
contiguous segment, replicated ones the same head slice on every rank. Replicated tokens join the
ring unrotated: a replicated K/V block is attended once, locally, as one more LSE partial (before
the ring's blocks for a prefix, after them for a suffix: single-rank key order); replicated queries
attend this rank's K/V shard, and every ring rank's partials are gathered and merged in rank order,
so every rank computes the same replicated output. Every step is differentiable: the collectives
are autograd Functions, the merge is torch arithmetic, each block's LSE carries its gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reference_impl.attention.backends import AttentionBackend
from reference_impl.parallel import comm
from reference_impl.parallel.state import get_ring_group, get_ring_rank, get_ring_world_size

Tensor = torch.Tensor
Partial = tuple[Tensor, Tensor]  # (out in fp32 [B, S, H, D], lse in fp32 [B, H, S])


@dataclass(frozen=True)
class Blocks:
    """One layer's kernel and its causal flag and scale: what every block is attended with."""

    impl: AttentionBackend
    causal: bool
    scale: float | None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Partial:
        out, lse = self.impl.forward(q, k, v, causal=causal, softmax_scale=self.scale, return_lse=True)
        return out.float(), lse


def merge(parts: Sequence[Partial]) -> Partial:
    """Online-softmax merge in the order given; a row with no key anywhere stays zero (LSE -inf)."""
    out_acc, lse_acc = parts[0]
    for out, lse in parts[1:]:
        new_lse = torch.logaddexp(lse_acc, lse)
        safe = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
        w_old = torch.exp(lse_acc - safe).transpose(1, 2).unsqueeze(-1)
        w_new = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
        out_acc, lse_acc = out_acc * w_old + out * w_new, new_lse
    return out_acc, lse_acc


def ring_blocks(blocks: Blocks, q: Tensor, k: Tensor, v: Tensor) -> Partial:
    """``q`` against every ring rank's K/V block, own block first; causal skips the blocks in the future."""
    group, world, rank = get_ring_group(), get_ring_world_size(), get_ring_rank()
    parts: list[Partial] = []
    unused: list[Tensor] = []
    for step in range(world):
        src = (rank - step) % world
        if step:
            k, v = comm.ring_shift([k, v], group)
        if blocks.causal and src > rank:
            unused += [k, v]  # a later block is entirely in the future of every local query
            continue
        parts.append(blocks.attend(q, k, v, blocks.causal and src == rank))
    out, lse = merge(parts)
    return comm.anchor(out, unused), lse


def ring_attention(blocks: Blocks, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return ring_blocks(blocks, q, k, v)[0].to(q.dtype)


def _gathered_in_rank_order(part: Partial) -> list[Partial]:
    """Every ring rank's partial, in rank order, on every ring rank (the same list everywhere)."""
    group = get_ring_group()
    outs = comm.all_gather(part[0].unsqueeze(0), 0, group).unbind(0)
    lses = comm.all_gather(part[1].unsqueeze(0), 0, group).unbind(0)
    return list(zip(outs, lses))


def replicated_tokens(
    blocks: Blocks, sharded: tuple[Tensor, Tensor, Tensor], replicated: tuple[Tensor, Tensor, Tensor], at_tail: bool
) -> tuple[Tensor, Tensor]:
    """(sharded output, replicated output) of ``[shards..., replicated]`` (``at_tail``) or ``[replicated, shards...]``.

    Causal: a sharded query never sees a replicated suffix, a replicated prefix query no shard.
    A replicated input used rank-partially goes through ``comm.replicated_input`` (its gradient is
    summed over the ring); the replicated × replicated block is the same on every rank and is not.
    """
    (q_s, k_s, v_s), (q_r, k_r, v_r) = sharded, replicated
    group, causal = get_ring_group(), blocks.causal

    def in_order(rep: Partial, rest: list[Partial]) -> list[Partial]:
        return rest + [rep] if at_tail else [rep] + rest

    shard_parts = [ring_blocks(blocks, q_s, k_s, v_s)]
    if not (causal and at_tail):
        k_rep, v_rep = (comm.replicated_input(t, group) for t in (k_r, v_r))
        shard_parts = in_order(blocks.attend(q_s, k_rep, v_rep, False), shard_parts)
    rep_parts: list[Partial] = []
    if not (causal and not at_tail):
        rep_parts = _gathered_in_rank_order(blocks.attend(comm.replicated_input(q_r, group), k_s, v_s, False))
    rep_parts = in_order(blocks.attend(q_r, k_r, v_r, causal), rep_parts)
    return merge(shard_parts)[0].to(q_s.dtype), merge(rep_parts)[0].to(q_r.dtype)


def replicated_kv_prefix(
    blocks: Blocks, q: Tensor, sharded_kv: tuple[Tensor, Tensor], replicated_kv: tuple[Tensor, Tensor]
) -> Tensor:
    """Sharded queries against ``[replicated K/V, shards...]`` (cross attention, not causal)."""
    group = get_ring_group()
    k_rep, v_rep = (comm.replicated_input(t, group) for t in replicated_kv)
    parts = [blocks.attend(q, k_rep, v_rep, False), ring_blocks(blocks, q, *sharded_kv)]
    return merge(parts)[0].to(q.dtype)
