"""Every available backend against a float64 reference, by FlashAttention's own error rule."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl.attention.backends import (
    BACKENDS,
    AttentionBackendEnum,
    MathBackend,
    TorchSDPABackend,
    _bool_mask_to_additive,
    backend_class,
    expand_kv_heads,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
AVAILABLE = [e for e, cls in BACKENDS.items() if cls.is_available()]


def naive_attention(q, k, v, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """softmax(QKᵀ)V with every op in ``dtype``: the error a plain low-precision kernel makes."""
    k, v = expand_kv_heads(k, v, q.shape[2])
    qt, kt, vt = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    scores = (qt @ kt.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vt).transpose(1, 2)


def fa_rule_bound(q, k, v, causal: bool, dtype: torch.dtype, ref64: torch.Tensor, k_factor: float = 2.0) -> float:
    naive = naive_attention(q, k, v, causal, dtype)
    floor = 1e-6 if dtype == torch.float32 else 1e-4
    return k_factor * (naive.double() - ref64).abs().max().item() + floor


def test_available_on_cpu():
    assert AttentionBackendEnum.TORCH_SDPA in AVAILABLE
    assert AttentionBackendEnum.MATH in AVAILABLE


@pytest.mark.parametrize("enum", list(AttentionBackendEnum))
def test_unavailable_backends_say_why(enum):
    cls = BACKENDS[enum]
    reason = cls.unavailable_reason()
    if cls.is_available():
        assert reason is None
    else:
        assert reason and len(reason) > 10
        if enum is AttentionBackendEnum.FA:
            assert "flash-attn" in reason
        if enum is AttentionBackendEnum.SAGE_ATTN:
            assert "sageattention" in reason


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    seq_q=st.integers(1, 48),
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([8, 16, 32, 64]),
    causal=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    backend=st.sampled_from(AVAILABLE),
    seed=st.integers(0, 2**16),
)
def test_backend_matches_float64_by_fa_rule(batch, seq_q, kv_heads, group, head_dim, causal, dtype, backend, seed):
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q = torch.randn(batch, seq_q, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, seq_q, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, seq_q, kv_heads, head_dim, generator=gen).to(dtype)
    ref64 = MathBackend().forward(q.double(), k.double(), v.double(), causal=causal)
    out = backend_class(backend)().forward(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref64).abs().max().item()
    assert err <= fa_rule_bound(q, k, v, causal, dtype, ref64), (backend, dtype, err)


@settings(max_examples=15, deadline=None)
@given(
    seq=st.integers(1, 40),
    heads=st.sampled_from([1, 2, 4]),
    causal=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_math_lse_is_logsumexp_of_scaled_scores(seq, heads, causal, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, seq, heads, 16, generator=gen).to(dtype) for _ in range(3))
    _, lse = MathBackend().forward(q, k, v, causal=causal, return_lse=True)
    scores = (q.float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(-1, -2)) / 4.0
    if causal:
        scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_lse_path_agrees_with_math(dtype, causal):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 33, 4, 32, generator=gen).to(dtype) for _ in range(3))
    out, lse = TorchSDPABackend().forward(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse = MathBackend().forward(q, k, v, causal=causal, return_lse=True)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    ref64 = MathBackend().forward(q.double(), k.double(), v.double(), causal=causal)
    assert (out.double() - ref64).abs().max().item() <= fa_rule_bound(q, k, v, causal, dtype, ref64)


def test_fully_masked_rows_give_zero_and_minus_inf_lse():
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[..., :2, :] = True
    out, lse = MathBackend().forward(q, k, v, return_lse=True, attn_mask=mask)
    assert torch.equal(out[:, 2:], torch.zeros_like(out[:, 2:]))
    assert torch.isneginf(lse[..., 2:]).all() and torch.isfinite(lse[..., :2]).all()


def test_sdpa_kernel_pin_math_runs_and_unknown_kernel_is_refused():
    q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
    pinned = TorchSDPABackend(kernel="math").forward(q, k, v)
    torch.testing.assert_close(pinned, TorchSDPABackend().forward(q, k, v), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unknown SDPA kernel"):
        TorchSDPABackend(kernel="turbo")


def test_gqa_rejects_indivisible_heads():
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="6 query heads"):
        MathBackend().forward(q, kv, kv)


def test_backend_names_parse_and_unknown_lists_valid():
    assert AttentionBackendEnum.parse("FA") is AttentionBackendEnum.FA
    assert AttentionBackendEnum.parse("torch_sdpa") is AttentionBackendEnum.TORCH_SDPA
    with pytest.raises(ValueError, match="torch_sdpa, fa, sage_attn, math"):
        AttentionBackendEnum.parse("flashy")


@pytest.mark.parametrize("kernel", [None, "math"])
@pytest.mark.parametrize("additive", [False, True])
def test_sdpa_mask_with_causal_folds_the_causal_limit(kernel, additive):
    """torch refuses attn_mask with is_causal=True; the backend must combine them itself."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 9, 2, 16, generator=gen) for _ in range(3))
    mask = torch.rand(2, 1, 9, 9, generator=gen) > 0.3
    mask[..., 0] = True
    given = _bool_mask_to_additive(mask, torch.float32) if additive else mask
    out = TorchSDPABackend(kernel=kernel).forward(q, k, v, causal=True, attn_mask=given)
    ref = MathBackend().forward(q, k, v, causal=True, attn_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
