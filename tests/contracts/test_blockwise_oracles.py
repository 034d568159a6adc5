"""The oracles in blocks of query rows against whole-matrix attention: the same numbers, in float64 rounding.

The whole-matrix references are torch's own (SDPA's math kernel in float64, autograd through it), independent
of the blocked code. Blocks are forced small (a few rows) so that every shape here spans many of them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.contracts import oracles
from harness.contracts.oracles import (
    attention_ref64,
    block_rows,
    gradients_ref64,
    naive_attention,
    naive_gradients,
    take,
)

SHIPPED_BLOCKS = dict(oracles.BLOCK_ELEMENTS)
NAMES = ("dq", "dk", "dv")


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oracles, "BLOCK_ELEMENTS", {"cuda": 64, "cpu": 64})


def _inputs(draw_shape: tuple[int, int, int, int, int, int], dtype: torch.dtype, seed: int):
    batch, sq, sk, heads, kv_heads, dim = draw_shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, sk, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _whole(q, k, v, causal, mask, scale):
    """torch's SDPA in float64 on the whole matrix (GQA expanded; causal top-left aligned, folded into the mask)."""
    heads = q.shape[2]
    qh, kh, vh = (t.double().repeat_interleave(heads // t.shape[2], 2).transpose(1, 2) for t in (q, k, v))
    keep = None
    if causal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
    if mask is not None:
        m = mask[:, None, None, :] if mask.dim() == 2 else mask
        keep = m if keep is None else keep & m
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep, scale=scale).transpose(1, 2)


shapes = st.tuples(
    st.integers(1, 2),  # batch
    st.integers(1, 19),  # query tokens
    st.integers(1, 19),  # key tokens
    st.sampled_from([1, 2, 4]),  # heads
    st.sampled_from([1, 2]),  # kv heads (divides heads below)
    st.sampled_from([3, 8, 40]),  # head dim
)


def _valid(shape: tuple[int, ...]) -> tuple[int, ...]:
    batch, sq, sk, heads, kv_heads, dim = shape
    return batch, sq, sk, heads, kv_heads if heads % kv_heads == 0 else 1, dim


def _mask(kind: str, batch: int, heads: int, sq: int, sk: int, seed: int) -> torch.Tensor | None:
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "key_padding":
        mask = torch.rand(batch, sk, generator=gen) > 0.3
        mask[:, 0] = True
        return mask
    mask = torch.rand(batch, heads, sq, sk, generator=gen) > 0.4
    mask[..., 0] = True
    return mask


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes,
    causal=st.booleans(),
    mask_kind=st.sampled_from(["none", "key_padding", "dense"]),
    scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_blocked_forward_is_whole_matrix_attention(shape, causal, mask_kind, scale, seed) -> None:
    batch, sq, sk, heads, kv_heads, dim = _valid(shape)
    q, k, v = _inputs((batch, sq, sk, heads, kv_heads, dim), torch.float32, seed)
    mask = _mask(mask_kind, batch, heads, sq, sk, seed)
    torch.testing.assert_close(
        attention_ref64(q, k, v, causal, scale, mask), _whole(q, k, v, causal, mask, scale), atol=1e-12, rtol=1e-12
    )


@settings(max_examples=40, deadline=None)
@given(shape=shapes, causal=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_rows_are_the_whole_outputs_rows(shape, causal, seed, data) -> None:
    """Any rows in any order, padding (-1) among them: what taking those rows of the whole gives, but for the
    order a GEMM of fewer rows may accumulate in (float64 rounding; a bf16 ulp or two in the naive one)."""
    batch, sq, sk, heads, kv_heads, dim = _valid(shape)
    q, k, v = _inputs((batch, sq, sk, heads, kv_heads, dim), torch.bfloat16, seed)
    rows = torch.tensor(data.draw(st.lists(st.integers(-1, sq - 1), min_size=1, max_size=2 * sq)))
    whole64 = take(attention_ref64(q, k, v, causal), rows)
    torch.testing.assert_close(attention_ref64(q, k, v, causal, rows=rows), whole64, atol=1e-12, rtol=1e-12)
    naive, whole = naive_attention(q, k, v, causal, rows=rows), take(naive_attention(q, k, v, causal), rows)
    assert naive.dtype == torch.bfloat16 and not naive[:, rows < 0].any()
    torch.testing.assert_close(naive, whole, atol=4 * 2**-8 * float(whole.abs().max()), rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    shape=shapes,
    causal=st.booleans(),
    mask_kind=st.sampled_from(["none", "key_padding", "dense"]),
    seed=st.integers(0, 2**16),
)
def test_blocked_gradients_are_autograd_through_whole_matrix_attention(shape, causal, mask_kind, seed) -> None:
    batch, sq, sk, heads, kv_heads, dim = _valid(shape)
    if causal and sq > sk:
        sq = sk  # a causal query row past the last key sees none: undefined in both
    q, k, v = _inputs((batch, sq, sk, heads, kv_heads, dim), torch.float32, seed)
    mask = _mask(mask_kind, batch, heads, sq, sk, seed)
    dout = torch.randn(batch, sq, heads, dim, generator=torch.Generator().manual_seed(seed + 1))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(_whole(*leaves, causal, mask, None), leaves, dout.double())
    got = gradients_ref64(q, k, v, causal, None, mask, dout=dout)
    torch.testing.assert_close(dict(zip(NAMES, got)), dict(zip(NAMES, expected)), atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_naive_gradients_are_autograd_through_naive_attention_in_one_block(dtype, monkeypatch) -> None:
    """Where one block holds every row, the naive gradients are autograd's op for op (bf16: every op rounded)."""
    monkeypatch.setattr(oracles, "BLOCK_ELEMENTS", {"cuda": 1 << 20, "cpu": 1 << 20})
    q, k, v = _inputs((1, 13, 13, 4, 2, 16), dtype, 5)
    dout = torch.randn(1, 13, 4, 16, generator=torch.Generator().manual_seed(9)).to(dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.repeat_interleave(4 // t.shape[2], 2).transpose(1, 2) for t in leaves)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * 16**-0.5
    keep = torch.ones(13, 13, dtype=torch.bool).tril()
    out = torch.matmul(torch.softmax(scores.masked_fill(~keep, float("-inf")), -1), vh).transpose(1, 2)
    expected = torch.autograd.grad(out, leaves, dout)
    got = naive_gradients(q, k, v, True, None, None, dout=dout)
    eps, largest = torch.finfo(dtype).eps, max(float(e.abs().max()) for e in expected)
    torch.testing.assert_close(dict(zip(NAMES, got)), dict(zip(NAMES, expected)), atol=2 * eps * largest, rtol=2 * eps)


def test_a_block_holds_the_budgets_rows_at_least_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oracles, "BLOCK_ELEMENTS", SHIPPED_BLOCKS)
    assert block_rows(1, 24, 118_800, "cuda") == 47  # HunyuanVideo 720p: 2^27 float64 scores, 1 GiB a temporary
    assert block_rows(1, 2, 12_288, "cpu") == 341
    assert block_rows(1, 1, 10**9, "cpu") == 1
