"""``usp.masked_replicated_prefix_parity``: a key mask together with a replicated prefix under SP.

sglang made this legal in PR #36735 (first released in 0.5.20): after the all-to-all the
attention is rank-local over the whole sequence, so the mask (replicated columns identical on
every rank, sharded columns gathered) applies as on one rank and the output can be bitwise.
Only targets declaring ``masked_replicated_prefix`` run it; ``usp.masked_rejects_replicated``
with ``refused = ["suffix", "kv_prefix"]`` checks that the other kinds are still refused.
"""

from __future__ import annotations

import torch

from harness.contracts.params import NUMERIC, PARALLEL, SHAPE, Params, bound_param
from harness.contracts.registry import Contract, RankContext, register
from harness.contracts.usp import REPLICATED, _bound, _not_causal, _qkv, _replicated_positive, _shard
from harness.contracts.verdict import RankOutcome, compare


def masked_replicated_prefix(ctx: RankContext, p: Params) -> RankOutcome:
    """[replicated prefix, shard r] with the matching slice of a key mask under SP equals the masked single-rank output."""
    total, rep = p.tokens, p.replicated
    q, k, v = _qkv(ctx, p, rep + total)
    gen = torch.Generator().manual_seed(p.seed + 3)
    full = torch.rand(p.batch, rep + total, generator=gen) > 0.3
    full[:, 0] = True  # no all-masked row
    full = full.to(ctx.device)
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v, attn_mask=full)
    sl = _shard(ctx, p)
    pick = lambda t: torch.cat([t[:, :rep], t[:, rep + sl.start : rep + sl.stop]], dim=1)  # noqa: E731
    with ctx.parallel(p.world_size, 1):
        attn = ctx.attention(p)
        out = attn(pick(q), pick(k), pick(v), attn_mask=pick(full), num_replicated_prefix=rep)
    return RankOutcome(stats=compare(out, pick(ref)), kernel=attn.kernel)


register(Contract(
    "usp.masked_replicated_prefix_parity",
    "a [B, n + S_local] key mask with a replicated prefix under SP equals the masked single-rank output bitwise",
    PARALLEL + SHAPE + NUMERIC + REPLICATED + (bound_param("bitwise"),),
    masked_replicated_prefix,
    requires=frozenset({"mask", "replicated_prefix", "masked_replicated_prefix"}),
    bound=_bound,
    checks=(_replicated_positive, _not_causal("the prefix order changes a causal mask: compare without causal")),
))
