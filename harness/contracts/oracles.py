"""Independent oracles of attention: exact float64, and the naive low precision computation, forward and backward.

Written here, independent of any target, so they cannot share a target's bugs: every attention
contract compares the target's output (single-rank and N-rank) with :func:`attention_ref64` by
the FlashAttention rule, ``max|out − ref64| ≤ K·max|naive_lowprec − ref64| + floor``, and every
gradient contract the target's dq, dk, dv with :func:`gradients_ref64` (autograd through the
float64 oracle for a seeded upstream gradient) by the same rule, the naive gradients being
autograd through the naive computation, every op in the low precision dtype (as FlashAttention's
tests take ``dq_pt``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from harness.contracts.bounds import FlashAttentionRule
from harness.contracts.stats import Stats


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


def _gradients_in(dtype: torch.dtype, q, k, v, causal, softmax_scale, attn_mask, dout) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out = _attention_in(dtype, *leaves, causal, softmax_scale, attn_mask)
        return torch.autograd.grad(out, leaves, dout.to(dtype))


def gradients_ref64(q, k, v, causal=False, softmax_scale=None, attn_mask=None, *, dout) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of exact float64 attention on the same inputs for the upstream gradient ``dout``."""
    return _gradients_in(torch.float64, q, k, v, causal, softmax_scale, attn_mask, dout)


def naive_gradients(q, k, v, causal=False, softmax_scale=None, attn_mask=None, *, dout) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of the naive attention, forward and backward in ``q.dtype``."""
    return _gradients_in(q.dtype, q, k, v, causal, softmax_scale, attn_mask, dout)


def _scaled(o: torch.Tensor, ref: torch.Tensor, allowed: float, what: str) -> str | None:
    """``o`` is ``ref`` times a constant other than 1 (within ``allowed``); None otherwise."""
    ratio = float((o * ref).sum() / (ref * ref).sum()) if ref.any() else 0.0
    if abs(ratio - 1.0) > 1e-3 and float((o - ratio * ref).abs().max()) <= allowed:
        return f"it is {ratio:.3g} times the {what}"
    return None


def diagnose_gradient(
    grad: torch.Tensor, ref64: torch.Tensor, naive: torch.Tensor, rule: FlashAttentionRule
) -> str | None:
    """What a gradient that missed the oracle looks like instead: all zeros, or the float64 gradient times a
    constant (a replicated gradient summed over W ranks is W times it). None: neither."""
    g, ref = grad.detach().double().cpu(), ref64.detach().double().cpu()
    if not torch.isfinite(g).all():
        return None
    if not g.any():
        return "the gradient is all zeros"
    allowed = rule.allowed(
        Stats(count=g.numel(), naive_err_ref64=float((naive.detach().double().cpu() - ref).abs().max()))
    )
    return _scaled(g, ref, allowed, "float64 gradient")


def diagnose(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float | None,
    attn_mask: torch.Tensor | None,
    pick: Callable[[torch.Tensor], torch.Tensor],
    rule: FlashAttentionRule,
) -> str | None:
    """What an output that missed the oracle looks like instead: all zeros, attention with ``causal``
    or the mask or the softmax scale ignored, or the attention times a constant. None: none of those.

    ``pick`` maps the whole-sequence attention to the layout of ``out``; a candidate explains the
    output when it is within the allowance the rule gave the real comparison.
    """
    o = out.detach().double().cpu()
    if not torch.isfinite(o).all():
        return None  # reported as non-finite values already
    if not o.any():
        return "the output is all zeros"
    base = (q, k, v, causal, softmax_scale, attn_mask)
    ref = pick(attention_ref64(*base)).cpu()
    naive = pick(naive_attention(*base)).double().cpu()
    allowed = rule.allowed(Stats(count=o.numel(), naive_err_ref64=float((naive - ref).abs().max())))

    def explains(candidate: torch.Tensor) -> bool:
        return float((o - candidate).abs().max()) <= allowed

    candidates: list[tuple[str, tuple]] = []
    if causal:
        candidates.append(
            ("it ignores causal: it matches non-causal attention", (q, k, v, False, softmax_scale, attn_mask))
        )
    if attn_mask is not None:
        candidates.append(
            ("it ignores the attention mask: it matches unmasked attention", (q, k, v, causal, softmax_scale, None))
        )
    candidates.append(
        ("it ignores the softmax scale: it matches attention with scale 1", (q, k, v, causal, 1.0, attn_mask))
    )
    for text, args in candidates:
        if explains(pick(attention_ref64(*args)).cpu()):
            return text
    return _scaled(o, ref, allowed, "attention")
