"""The MATH backend's kernel: explicit softmax(QKᵀ·scale)V with its log-sum-exp, in blocks of query rows.

Memory is O(S·block) forward and backward: the forward keeps only the output and the LSE, the backward
recomputes each block's probabilities from them (as FlashAttention's backward does) and takes the LSE's
own gradient too, so a ring merge through it can be differentiated at any length. A block's rows are
computed as the whole matrix computes them (the whole key row, no online merge); how many rows a block
holds depends on the key length only, never on the head count, so a head-sharded (Ulysses) call splits
rows into the same blocks as the single-rank one.
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor
#: Query rows × keys in one block, per head (fp32: 16 MiB a head per temporary).
BLOCK_SCORES_PER_HEAD = 1 << 22


def block_rows(keys: int) -> int:
    return max(1, BLOCK_SCORES_PER_HEAD // max(1, keys))


def _rows_of(mask: Tensor | None, start: int, stop: int, queries: int) -> Tensor | None:
    """The block's rows of a mask broadcastable to ``[B, H, Sq, Sk]`` (a mask without a query dim as it is)."""
    if mask is None or mask.dim() < 2 or mask.shape[-2] != queries:
        return mask
    return mask[..., start:stop, :]


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool, additive: Tensor | None, start: int) -> Tensor:
    """Scaled scores of the query rows ``q`` (``[B, H, b, D]``, rows ``start``...) against every key."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:  # top-left aligned, as SDPA's is_causal
        rows = torch.arange(start, start + q.shape[-2], device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(k.shape[-2], device=q.device)[None, :] > rows, float("-inf"))
    if additive is not None:
        scores = scores + additive
    return scores


def _finite(lse: Tensor) -> Tensor:
    """The LSE where a row saw no key (-inf) replaced by 0, so its probabilities are 0, not NaN."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


class BlockedAttention(torch.autograd.Function):
    """(out, lse) of ``[B, H, S, D]`` inputs in the compute dtype; ``additive`` a float mask or None."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, additive: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        queries = q.shape[-2]
        out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_empty(q.shape[:-1])
        size = block_rows(k.shape[-2])
        for start in range(0, queries, size):
            stop = min(queries, start + size)
            scores = _scores(q[..., start:stop, :], k, scale, causal, _rows_of(additive, start, stop, queries), start)
            lse[..., start:stop] = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - _finite(lse[..., start:stop]).unsqueeze(-1))
            out[..., start:stop, :] = torch.matmul(probs, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.additive = scale, causal, additive
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        queries, size = q.shape[-2], block_rows(k.shape[-2])
        for start in range(0, queries, size):
            stop = min(queries, start + size)
            rows, d_rows = q[..., start:stop, :], dout[..., start:stop, :]
            scores = _scores(rows, k, ctx.scale, ctx.causal, _rows_of(ctx.additive, start, stop, queries), start)
            probs = torch.exp(scores - _finite(lse[..., start:stop]).unsqueeze(-1))
            dv += torch.matmul(probs.transpose(-1, -2), d_rows)
            # d out/d scores = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)); d lse/d scores = P
            inner = (d_rows * out[..., start:stop, :]).sum(-1, keepdim=True)
            if dlse is not None:
                inner = inner - dlse[..., start:stop].unsqueeze(-1)
            dscores = probs * (torch.matmul(d_rows, v.transpose(-1, -2)) - inner) * ctx.scale
            dq[..., start:stop, :] = torch.matmul(dscores, k)
            dk += torch.matmul(dscores.transpose(-1, -2), rows)
        return dq, dk, dv, None, None, None
