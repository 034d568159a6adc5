"""The MATH backend's blocked kernel against autograd through the whole-matrix formula: out, LSE and every
gradient (the LSE's own too, which a ring merge differentiates through), over many blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl.attention import blocked_math
from reference_impl.attention.blocked_math import BlockedAttention


def _whole(q, k, v, scale, causal, additive):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if additive is not None:
        scores = scores + additive
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1), v), lse


@settings(max_examples=40, deadline=None)
@given(
    queries=st.integers(1, 17),
    keys=st.integers(1, 17),
    heads=st.sampled_from([1, 3]),
    causal=st.booleans(),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_blocked_attention_is_the_whole_formula_with_its_gradients(queries, keys, heads, causal, masked, seed) -> None:
    if causal:
        queries = min(queries, keys)  # a causal row past the last key sees none: NaN in the whole formula
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, n, 8, generator=gen, dtype=torch.float64) for n in (queries, keys, keys))
    additive = None
    if masked:
        keep = torch.rand(2, 1, 1, keys, generator=gen) > 0.3
        keep[..., 0] = True
        additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    dout, dlse = torch.randn(2, heads, queries, 8, generator=gen, dtype=torch.float64), torch.randn(2, heads, queries)
    results = []
    for fn in (_whole, BlockedAttention.apply):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves, 0.3, causal, additive)
        grads = torch.autograd.grad((out, lse), leaves, (dout, dlse.double()))
        results.append({"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), grads))})
    torch.testing.assert_close(results[1], results[0], atol=1e-12, rtol=1e-12)


@pytest.fixture(autouse=True)
def _blocks_of_a_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocked_math, "BLOCK_SCORES_PER_HEAD", 24)


def test_rows_with_no_key_give_zeros_and_an_lse_of_minus_infinity() -> None:
    q = k = v = torch.ones(1, 1, 3, 4)
    additive = torch.full((1, 1, 1, 3), float("-inf"))
    out, lse = BlockedAttention.apply(q, k, v, 1.0, False, additive)
    assert (out.abs().max().item(), lse.isneginf().all().item()) == (0.0, True)


def test_a_block_holds_the_same_rows_whatever_the_head_count() -> None:
    assert blocked_math.block_rows(5) == 4  # 24 scores per head: 4 rows of 5 keys, for 1 head or 40
