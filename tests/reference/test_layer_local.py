"""USPAttention's single-rank path and the guards that need no process group."""

from __future__ import annotations

import pytest
import torch

from reference_impl import AttentionBackendEnum, LocalAttention, USPAttention, set_forward_context
from reference_impl.attention.backends import MathBackend


def qkv(seq=12, heads=4, kv_heads=4, dim=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, seq, heads, dim, generator=gen).to(dtype),
        torch.randn(1, seq, kv_heads, dim, generator=gen).to(dtype),
        torch.randn(1, seq, kv_heads, dim, generator=gen).to(dtype),
    )


@pytest.fixture(autouse=True)
def _ctx():
    with set_forward_context():
        yield


def test_single_rank_replicated_tokens_are_plain_tokens():
    q, k, v = qkv()
    attn = USPAttention(4, 16)
    ref = attn(q, k, v)
    assert torch.equal(attn(q, k, v, num_replicated_suffix=3), ref)
    assert torch.equal(attn(q, k, v, num_replicated_prefix=3), ref)
    assert torch.equal(attn(q, k, v, num_replicated_kv_prefix=3), ref)


def test_single_rank_varlen_attends_valid_tokens_and_zero_pads():
    q, k, v = qkv()
    attn = USPAttention(4, 16)
    out = attn(q, k, v, seq_lens=[7])
    assert torch.equal(out[:, :7], attn(q[:, :7], k[:, :7], v[:, :7]))
    assert torch.equal(out[:, 7:], torch.zeros_like(out[:, 7:]))


def test_key_padding_mask_matches_truncation():
    q, k, v = qkv()
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[:, :5] = True
    attn = USPAttention(4, 16, backend="math")
    out = attn(q, k, v, attn_mask=mask)
    ref = MathBackend().forward(q, k[:, :5], v[:, :5])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_gqa_local():
    q, k, v = qkv(heads=4, kv_heads=2)
    out = LocalAttention(4, 16, num_kv_heads=2)(q, k, v)
    ref = MathBackend().forward(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_varlen_with_mask_or_replicated_is_refused():
    q, k, v = qkv()
    attn = USPAttention(4, 16)
    with pytest.raises(ValueError, match="seq_lens"):
        attn(q, k, v, seq_lens=[12], attn_mask=torch.ones(1, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="seq_lens"):
        attn(q, k, v, seq_lens=[12], num_replicated_suffix=2)


def test_heads_not_multiple_of_kv_heads():
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        USPAttention(6, 16, num_kv_heads=4)


def test_layer_exposes_backend_and_dtype():
    attn = USPAttention(4, 16, default_attention_backend=AttentionBackendEnum.MATH)
    assert attn.backend is AttentionBackendEnum.MATH
    assert attn.dtype == torch.float32


def test_sdpa_kernel_pin_only_for_sdpa():
    with pytest.raises(ValueError, match="only applies to torch_sdpa"):
        USPAttention(4, 16, backend="math", sdpa_kernel="math")
