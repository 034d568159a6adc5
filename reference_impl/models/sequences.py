"""Token streams of a batch for the DiTs: per-item lengths, key masks, contiguous sequence-parallel shards.

A batch whose items have different token counts is padded to its longest item and a key
mask (True = a real token) marks the padding; when every item has the same count there is
no mask, as in diffusers, so the unmasked attention path runs. Under Ulysses sequence
parallelism a stream is split into contiguous, equal shards in rank order: the all-to-all
then hands every rank the keys in single-rank order, which is what keeps SP bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from reference_impl.models.layers import even_shard_bounds
from reference_impl.parallel import comm
from reference_impl.parallel.state import get_ring_world_size, get_sp_rank, get_sp_world_size, get_ulysses_group

Tensor = torch.Tensor
Rope = tuple[Tensor, Tensor]


def key_mask(lengths: Sequence[int], total: int, device: torch.device | str | None = None) -> Tensor | None:
    """``[B, total]`` True on each item's first ``lengths[i]`` tokens; None when every item fills ``total``."""
    if all(n == total for n in lengths):
        return None
    return torch.arange(total, device=device)[None, :] < torch.tensor(list(lengths), device=device)[:, None]


@dataclass(frozen=True)
class TokenStream:
    """``tokens [B, S, dim]`` padded to the longest item, their RoPE rows ``[B, S, d/2]`` and key mask ``[B, S]``."""

    tokens: Tensor
    rope: Rope
    mask: Tensor | None
    lengths: tuple[int, ...]

    @staticmethod
    def pad(items: Sequence[Tensor], ropes: Sequence[Rope]) -> TokenStream:
        """Zero-pad per-item ``[S_i, dim]`` tokens and ``[S_i, d/2]`` tables to the longest item."""
        lengths = tuple(t.shape[0] for t in items)
        tokens = pad_sequence(list(items), batch_first=True)
        rope = (
            pad_sequence([c for c, _ in ropes], batch_first=True),
            pad_sequence([s for _, s in ropes], batch_first=True),
        )
        return TokenStream(tokens, rope, key_mask(lengths, tokens.shape[1], tokens.device), lengths)

    def shard(self, rank: int, world: int) -> TokenStream:
        """Rank ``rank``'s contiguous shard of the padded sequence (lengths stay the global ones)."""
        start, end = even_shard_bounds(self.tokens.shape[1], rank, world)
        mask = None if self.mask is None else self.mask[:, start:end]
        return TokenStream(
            self.tokens[:, start:end], (self.rope[0][:, start:end], self.rope[1][:, start:end]), mask, self.lengths
        )

    def replace(self, tokens: Tensor) -> TokenStream:
        return TokenStream(tokens, self.rope, self.mask, self.lengths)


def ulysses_rank_and_world(model: str) -> tuple[int, int]:
    """This rank and the SP degree; the DiTs shard over Ulysses only, so a ring degree > 1 is refused."""
    world = get_sp_world_size()
    if world > 1 and get_ring_world_size() > 1:
        raise NotImplementedError(
            f"{model} shards tokens over Ulysses only: ring degree {get_ring_world_size()} must be 1"
        )
    return get_sp_rank(), world


def gather_shards(shard: Tensor, world: int) -> Tensor:
    """Every rank's ``[B, S_local, ...]`` shard, concatenated in rank order (a no-op on one rank)."""
    return shard if world == 1 else comm.all_gather(shard.contiguous(), dim=1, group=get_ulysses_group())
