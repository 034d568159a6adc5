"""Independent oracles of attention: exact float64, and the naive low precision computation.

Written here, independent of any target, so they cannot share a target's bugs: every attention
contract compares the target's output (single-rank and N-rank) with :func:`attention_ref64` by
the FlashAttention rule, ``max|out − ref64| ≤ K·max|naive_lowprec − ref64| + floor``.
"""

from __future__ import annotations

import math

import torch


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: KV head j serves the contiguous query heads [j·r, (j+1)·r), as every backend does."""
    return t if t.shape[2] == heads else t.repeat_interleave(heads // t.shape[2], dim=2)


def _attention_in(
    dtype: torch.dtype,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float | None,
    attn_mask: torch.Tensor | None,
) -> torch.Tensor:
    """softmax(QKᵀ·scale)V on ``[B, S, H, D]`` with every op in ``dtype``."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    heads = q.shape[2]
    qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, _expand_kv(k, heads), _expand_kv(v, heads)))
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    keep = None
    if causal:
        sq, sk = scores.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril()
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dim() == 4 else attn_mask[:, None, None, :]
        keep = mask if keep is None else keep & mask
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vh).transpose(1, 2)


def attention_ref64(q, k, v, causal=False, softmax_scale=None, attn_mask=None) -> torch.Tensor:
    """Exact attention in float64 on the very same (already low precision) inputs."""
    return _attention_in(torch.float64, q, k, v, causal, softmax_scale, attn_mask)


def naive_attention(q, k, v, causal=False, softmax_scale=None, attn_mask=None) -> torch.Tensor:
    """The naive low precision reference: matmul, scale, softmax and matmul all in ``q.dtype``."""
    return _attention_in(q.dtype, q, k, v, causal, softmax_scale, attn_mask)
