"""Independent oracles of attention: exact float64 and the naive low precision computation, forward and backward,
in blocks of query rows, so memory is O(S·block), never an S×S matrix.

Written here, independent of any target, so they cannot share a target's bugs (docs/judging.md: the rule
they serve). A block computes its rows as the textbook softmax(QKᵀ·scale)V does (the whole key row, no
online merge): blocking changes a figure only by the order a GEMM of fewer rows accumulates in. The
backward follows autograd's own ops, dK and dV summed over query blocks in the precision a GEMM
accumulates in (float64 for the oracle, float32 for the naive one): at the default cases' shapes the
figures are autograd's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from harness.contracts.bounds import FlashAttentionRule
from harness.contracts.stats import Stats, compare

Tensor = torch.Tensor
#: Score elements of one query block on each kind of device: what bounds every temporary (float64: 1 GiB on a
#: GPU, 64 MiB on a CPU, where ranks share the host's memory).
BLOCK_ELEMENTS = {"cuda": 1 << 27, "cpu": 1 << 23}


def block_rows(batch: int, heads: int, keys: int, device: torch.device | str) -> int:
    """How many query rows one block holds: :data:`BLOCK_ELEMENTS` score elements, at least one row."""
    budget = BLOCK_ELEMENTS["cuda" if torch.device(device).type == "cuda" else "cpu"]
    return max(1, budget // max(1, batch * heads * keys))


@dataclass(frozen=True)
class Asked:
    """What the attention was asked to compute, on the whole sequence in single-rank order: the oracle's inputs."""

    q: Tensor
    k: Tensor
    v: Tensor
    causal: bool = False
    mask: Tensor | None = None
    scale: float | None = None

    @property
    def args(self) -> tuple[Tensor, Tensor, Tensor, bool, float | None, Tensor | None]:
        """The oracles' positional arguments."""
        return self.q, self.k, self.v, self.causal, self.scale, self.mask

    def with_(self, **changes: Any) -> Asked:
        return dataclasses.replace(self, **changes)

    def oracles(self, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(float64 attention, the naive low precision attention) of these inputs, for the query ``rows``."""
        return attention_ref64(*self.args, rows=rows), naive_attention(*self.args, rows=rows)


def take(t: Tensor, rows: Tensor) -> Tensor:
    """The sequence rows ``rows`` of ``t`` (dim 1); a row index of -1 gives a zero row (varlen padding)."""
    rows = rows.to(t.device)
    out = t.index_select(1, rows.clamp(min=0))
    padding = rows < 0
    if padding.any():
        out[:, padding] = 0
    return out


def _heads_first(t: Tensor, heads: int, dtype: torch.dtype) -> Tensor:
    """``[B, S, Hkv, D]`` as a contiguous ``[B, H, S, D]`` in ``dtype``; GQA: KV head j serves query heads
    [j·r, (j+1)·r), as every backend does."""
    if t.shape[2] != heads:
        t = t.repeat_interleave(heads // t.shape[2], dim=2)
    return t.transpose(1, 2).to(dtype).contiguous()


def _keep(rows: Tensor, keys: int, causal: bool, mask: Tensor | None) -> Tensor | None:
    """Which keys the query rows ``rows`` see: ``[B|1, H|1, len(rows), keys]`` bool, or None (all of them)."""
    keep = None
    if causal:  # top-left aligned, as SDPA's is_causal: row i sees keys 0..i
        keep = torch.arange(keys, device=rows.device)[None, :] <= rows[:, None]
    if mask is not None:
        m = mask[:, None, None, :] if mask.dim() == 2 else mask.index_select(2, rows.to(mask.device))
        m = m.to(rows.device)
        keep = m if keep is None else keep & m
    return keep


def _probs(dtype: torch.dtype, q_rows: Tensor, keys_t: Tensor, scale: float, keep: Tensor | None) -> Tensor:
    """softmax(q·kᵀ·scale) of a block of query rows (``[B, H, b, D]``) against every key, every op in ``dtype``."""
    scores = torch.matmul(q_rows.to(dtype), keys_t) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1)


def _scale(q: Tensor, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _blocks(rows: Tensor, size: int) -> Iterator[Tensor]:
    for start in range(0, rows.numel(), size):
        yield rows[start : start + size]


def _attention_in(
    dtype: torch.dtype,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    softmax_scale: float | None,
    attn_mask: Tensor | None,
    rows: Tensor | None,
) -> Tensor:
    """softmax(QKᵀ·scale)V on ``[B, S, H, D]`` with every op in ``dtype``, for the query ``rows`` (all when None;
    a row index of -1 gives a zero row, as varlen padding holds)."""
    batch, length, heads, _ = q.shape
    index = torch.arange(length, device=q.device) if rows is None else rows.to(q.device)
    keys_t = _heads_first(k, heads, dtype).transpose(-1, -2)
    values = _heads_first(v, heads, dtype)
    out = torch.zeros(batch, index.numel(), heads, v.shape[-1], dtype=dtype, device=q.device)
    valid = (index >= 0).nonzero().flatten()
    for pos in _blocks(valid, block_rows(batch, heads, k.shape[1], q.device)):
        r = index[pos]
        probs = _probs(
            dtype, q[:, r].transpose(1, 2), keys_t, _scale(q, softmax_scale), _keep(r, k.shape[1], causal, attn_mask)
        )
        out[:, pos] = torch.matmul(probs, values).transpose(1, 2)
    return out


def attention_ref64(q, k, v, causal=False, softmax_scale=None, attn_mask=None, rows=None) -> Tensor:
    """Exact attention in float64 on the very same (already low precision) inputs, for the query ``rows``."""
    return _attention_in(torch.float64, q, k, v, causal, softmax_scale, attn_mask, rows)


def naive_attention(q, k, v, causal=False, softmax_scale=None, attn_mask=None, rows=None) -> Tensor:
    """The naive low precision reference: matmul, scale, softmax and matmul all in ``q.dtype``."""
    return _attention_in(q.dtype, q, k, v, causal, softmax_scale, attn_mask, rows)


def _gradients_in(
    dtype: torch.dtype, q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale, attn_mask, dout: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of :func:`_attention_in` for the upstream gradient ``dout``, block by block, autograd's ops
    in ``dtype``; dk and dv summed over the blocks in the GEMM's accumulation precision."""
    batch, length, heads, _ = q.shape
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    keys, values = _heads_first(k, heads, dtype), _heads_first(v, heads, dtype)
    scale = _scale(q, softmax_scale)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(keys.shape, dtype=acc, device=q.device)
    dv = torch.zeros(values.shape, dtype=acc, device=q.device)
    every = torch.arange(length, device=q.device)
    for r in _blocks(every, block_rows(batch, heads, k.shape[1], q.device)):
        q_rows, dout_rows = (t[:, r].transpose(1, 2).to(dtype) for t in (q, dout))
        probs = _probs(dtype, q_rows, keys.transpose(-1, -2), scale, _keep(r, k.shape[1], causal, attn_mask))
        dv += torch.matmul(probs.transpose(-1, -2).to(acc), dout_rows.to(acc))  # out = probs @ v
        dprobs = torch.matmul(dout_rows, values.transpose(-1, -2))
        dscores = torch._softmax_backward_data(dprobs, probs, -1, dtype)  # autograd's op; masked keys have p = 0
        dproduct = dscores * scale  # scores = (q @ kᵀ) · scale
        dq[:, r] = torch.matmul(dproduct, keys).transpose(1, 2)
        dk += torch.matmul(dproduct.transpose(-1, -2).to(acc), q_rows.to(acc))
    return dq, _kv_grad(dk, k.shape[2], dtype), _kv_grad(dv, v.shape[2], dtype)


def _kv_grad(grad: Tensor, kv_heads: int, dtype: torch.dtype) -> Tensor:
    """``[B, H, S, D]`` back to the input's ``[B, S, Hkv, D]``: a KV head's gradient is its query group's sum
    (in ``dtype``, as the backward of the KV heads' repeat sums it)."""
    batch, heads, length, dim = grad.shape
    grad = grad.to(dtype).transpose(1, 2)
    if kv_heads != heads:
        grad = grad.reshape(batch, length, kv_heads, heads // kv_heads, dim).sum(3)
    return grad.contiguous()


def gradients_ref64(q, k, v, causal=False, softmax_scale=None, attn_mask=None, *, dout) -> tuple[Tensor, ...]:
    """(dq, dk, dv) of exact float64 attention on the same inputs for the upstream gradient ``dout``."""
    return _gradients_in(torch.float64, q, k, v, causal, softmax_scale, attn_mask, dout)


def naive_gradients(q, k, v, causal=False, softmax_scale=None, attn_mask=None, *, dout) -> tuple[Tensor, ...]:
    """(dq, dk, dv) of the naive attention, forward and backward in ``q.dtype``."""
    return _gradients_in(q.dtype, q, k, v, causal, softmax_scale, attn_mask, dout)


def _scaled(o: Tensor, ref: Tensor, allowed: float, what: str) -> str | None:
    """``o`` is ``ref`` times a constant other than 1 (within ``allowed``); None otherwise."""
    o64, ref64 = o.detach().double(), ref.detach().double()
    ratio = float((o64 * ref64).sum() / (ref64 * ref64).sum()) if ref64.any() else 0.0
    if abs(ratio - 1.0) > 1e-3 and float((o64 - ratio * ref64).abs().max()) <= allowed:
        return f"it is {ratio:.3g} times the {what}"
    return None


def diagnose_gradient(grad: Tensor, ref64: Tensor, naive: Tensor, rule: FlashAttentionRule) -> str | None:
    """What a gradient that missed the oracle looks like instead: all zeros, or the float64 gradient times a
    constant (a replicated gradient summed over W ranks is W times it). None: neither."""
    if not torch.isfinite(grad).all():
        return None
    if not grad.any():
        return "the gradient is all zeros"
    return _scaled(grad, ref64, rule.allowed(compare(naive, ref64, ref64, naive)), "float64 gradient")


def diagnose(out: Tensor, asked: Asked, rows: Tensor | None, rule: FlashAttentionRule) -> str | None:
    """What an output that missed the oracle looks like instead: all zeros, attention with ``causal``
    or the mask or the softmax scale ignored, or the attention times a constant. None: none of those.

    ``out`` holds the query ``rows`` of the whole sequence (as :func:`attention_ref64` takes them); a
    candidate explains it when it is within the allowance the rule gave the real comparison.
    """
    if not torch.isfinite(out).all():
        return None  # reported as non-finite values already
    if not out.any():
        return "the output is all zeros"
    ref, naive = asked.oracles(rows)
    allowed = rule.allowed(_oracle_stats(naive, ref))
    candidates: list[tuple[str, Asked]] = []
    if asked.causal:
        candidates.append(("it ignores causal: it matches non-causal attention", asked.with_(causal=False)))
    if asked.mask is not None:
        candidates.append(("it ignores the attention mask: it matches unmasked attention", asked.with_(mask=None)))
    if asked.scale is not None:
        default = 1.0 / math.sqrt(asked.q.shape[-1])
        candidates.append(
            (f"it ignores the softmax scale {asked.scale:g}: it matches the default 1/√d", asked.with_(scale=default))
        )
    candidates.append(("it ignores the softmax scale: it matches attention with scale 1", asked.with_(scale=1.0)))
    for text, candidate in candidates:
        if compare(out, attention_ref64(*candidate.args, rows=rows)).max_abs <= allowed:
            return text
    return _scaled(out, ref, allowed, "attention")


def _oracle_stats(naive: Tensor, ref64: Tensor) -> Stats:
    """The naive computation's own distance to float64, as the rule's allowance reads it."""
    return compare(naive, ref64, ref64, naive)
