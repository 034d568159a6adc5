"""Bounds, the FlashAttention-rule oracles and mergeable figures (no ranks needed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.contracts.bounds import (
    NON_DETERMINISTIC,
    AbsBound,
    Bitwise,
    FlashAttentionRule,
    JitterBound,
    judge,
    parse_bound,
)
from harness.contracts.oracles import attention_ref64, naive_attention
from harness.contracts.stats import Stats, compare, magnitude_floor


def _qkv(dtype: torch.dtype, heads: int = 4, kv_heads: int = 4, seq: int = 24, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, seq, h, 16, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))


def test_bitwise_holds_only_for_equal_tensors():
    a = torch.randn(3, 5)
    assert judge(Bitwise(), compare(a, a.clone())) is None
    b = a.clone()
    b[1, 2] += 1e-6
    reason = judge(Bitwise(), compare(b, a))
    assert reason is not None and "1 of 15 elements differ" in reason


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("bound", [Bitwise(), AbsBound(1e9), FlashAttentionRule(1e9, 1e9)])
def test_non_finite_output_fails_under_every_bound(bad, bound):
    ref = torch.randn(4, 4)
    out = ref.clone()
    out[0, 0] = bad
    stats = compare(out, ref, ref.double(), ref.clone())
    reason = judge(bound, stats)
    assert reason is not None and "non-finite values: 1 in the output" in reason
    assert stats.figures()["nonfinite"] == 1


def test_non_finite_reference_fails_too():
    out = torch.zeros(3)
    ref = torch.tensor([0.0, float("nan"), 0.0])
    assert "1 in the reference" in judge(AbsBound(1.0), compare(out, ref))


def test_abs_bound_is_inclusive():
    ref = torch.zeros(4, dtype=torch.float64)
    assert judge(AbsBound(0.5), compare(ref + 0.5, ref)) is None
    assert "max abs 5.010e-01 > 0.5" == judge(AbsBound(0.5), compare(ref + 0.501, ref))


def test_fa_rule_allows_k_times_the_naive_error_plus_the_floor():
    rule = FlashAttentionRule(k=2, floor=1e-3, dtype="bf16", ulps=0)
    assert rule.describe() == "max|out − ref64| ≤ 2·max|naive_bf16 − ref64| + 0.001"
    at_limit = Stats(count=1, err_ref64=2 * 0.01 + 1e-3, naive_err_ref64=0.01, ref64_max=3.0)
    assert rule.violation(at_limit) is None
    over = Stats(count=1, err_ref64=2 * 0.01 + 1.1e-3, naive_err_ref64=0.01, ref64_max=3.0)
    assert "> 2·1.000e-02 + 0.001 + 0·" in rule.violation(over)


@pytest.mark.parametrize(
    ("magnitude", "ulp"), [(1.0, 2.0**-23), (1.5, 2.0**-23), (2.0, 2.0**-22), (3.24, 2.0**-22), (0.3, 2.0**-25)]
)
def test_the_fa_rules_floor_scales_with_the_references_magnitude(magnitude: float, ulp: float) -> None:
    """ULPS fp32 ulps at max|ref64| on top of K·naive + FLOOR: an fp32 gradient of 3.24 may be 16·2^-22 off."""
    rule = FlashAttentionRule(k=2, floor=1e-6, dtype="fp32")
    stats = Stats(count=1, err_ref64=0.0, naive_err_ref64=1e-7, ref64_max=magnitude)
    assert rule.allowed(stats) == pytest.approx(2e-7 + 1e-6 + 16 * ulp, rel=1e-12)
    assert rule.describe() == "max|out − ref64| ≤ 2·max|naive_fp32 − ref64| + 1e-06 + 16·ulp_fp32(max|ref64|)"


def test_a_jitter_bound_allows_twice_the_spread_in_ulps_and_says_why() -> None:
    bound = JitterBound(spread_ulps=1.0)
    assert bound.violation(Stats(count=4, mismatched=2, max_abs=1e-3, max_ulps=2.0)) is None
    reason = bound.violation(Stats(count=4, mismatched=2, max_abs=4e-3, max_ulps=4.0))
    assert reason.startswith("4 ulp (max abs 4.000e-03) from the single-rank reference > 2 ulp")
    assert NON_DETERMINISTIC in reason and NON_DETERMINISTIC in bound.describe()


@pytest.mark.parametrize(
    ("values", "ulps"),
    [
        (torch.tensor([1.0, 1.0078125], dtype=torch.bfloat16), 1.0),  # the next bf16 after 1
        (torch.tensor([3.0, 3.03125], dtype=torch.bfloat16), 2.0),  # 2 bf16 ulps in [2, 4)
        (torch.tensor([1.0, 1.0 + 2**-23], dtype=torch.float32), 1.0),
        (
            torch.tensor([2.0**-12, 2.0**-12 + 2.0**-19], dtype=torch.bfloat16),
            1 / 16,
        ),  # below the floor (2^-8): its ulp
    ],
)
def test_compare_measures_the_distance_in_ulps_of_the_expected_dtype(values: torch.Tensor, ulps: float) -> None:
    expected, out = values[:1], values[1:]
    assert compare(out, expected, ulps_above=magnitude_floor(torch.tensor([1.0]))).max_ulps == ulps


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ref64_is_exact_attention_in_float64(causal):
    q, k, v = _qkv(torch.bfloat16, heads=4, kv_heads=2)
    expected = F.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))),
        is_causal=causal,
    ).transpose(1, 2)
    assert attention_ref64(q, k, v, causal).dtype == torch.float64
    torch.testing.assert_close(attention_ref64(q, k, v, causal), expected, atol=1e-12, rtol=0)


def test_naive_reference_is_computed_in_the_low_precision():
    q, k, v = _qkv(torch.bfloat16)
    ref64 = attention_ref64(q, k, v)
    naive = naive_attention(q, k, v)
    assert naive.dtype == torch.bfloat16
    naive_err = (naive.double() - ref64).abs().max().item()
    fp32_err = (naive_attention(q.float(), k.float(), v.float()).double() - ref64).abs().max().item()
    assert naive_err > 100 * fp32_err  # every op rounded to bf16, not an fp32 computation cast at the end


def test_key_padding_and_dense_masks_in_the_oracles():
    q, k, v = _qkv(torch.float32, seq=8)
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[:, 5:] = False
    masked = attention_ref64(q, k, v, attn_mask=keep)
    truncated = attention_ref64(q, k[:, :5], v[:, :5])
    torch.testing.assert_close(masked, truncated, atol=1e-12, rtol=0)
    dense = keep[:, None, None, :].expand(2, 4, 8, 8)
    torch.testing.assert_close(attention_ref64(q, k, v, attn_mask=dense), masked, atol=0, rtol=0)


def test_stats_of_shards_merge_to_the_stats_of_the_whole():
    gen = torch.Generator().manual_seed(3)
    out, ref = torch.randn(2, 10, 3, generator=gen), torch.randn(2, 10, 3, generator=gen)
    whole = compare(out, ref)
    merged = compare(out[:, :4], ref[:, :4]).merge(compare(out[:, 4:], ref[:, 4:]))
    assert merged.count == whole.count and merged.mismatched == whole.mismatched
    assert merged.max_abs == whole.max_abs
    keys = ("mean_abs", "rel_err")
    assert {k: merged.figures()[k] for k in keys} == pytest.approx(
        {k: whole.figures()[k] for k in keys}, rel=1e-12, abs=0
    )


def test_compare_refuses_shape_mismatch():
    with pytest.raises(ValueError, match=r"output shape \(2, 3\) != expected shape \(3, 2\)"):
        compare(torch.zeros(2, 3), torch.zeros(3, 2))


@pytest.mark.parametrize(
    "text,expected",
    [
        ("bitwise", Bitwise()),
        ("abs:1e-2", AbsBound(0.01)),
        ("fa", FlashAttentionRule(2.0, 1e-6, "bf16")),
        ("fa:3:1e-5", FlashAttentionRule(3.0, 1e-5, "bf16")),
        ("fa:3:1e-5:0", FlashAttentionRule(3.0, 1e-5, "bf16", 0.0)),
    ],
)
def test_parse_bound(text, expected):
    assert parse_bound(text, "bf16") == expected


@pytest.mark.parametrize("text", ["bitwize", "abs", "abs:-1", "abs:x", "fa:1:2:3:4:5", "fa:1:2:-3", "abs:nan"])
def test_parse_bound_rejects_bad_syntax(text):
    with pytest.raises(ValueError, match="bitwise"):
        parse_bound(text, "fp32")


def test_result_json_has_no_nan_at_any_depth():
    from harness.results import FAILED, CaseResult

    v = CaseResult("c", "usp.x", FAILED, "r", {"max_abs": float("nan"), "paths": {"a": {"max_abs": float("inf")}}}, "b")
    assert v.to_dict()["figures"] == {"max_abs": "nan", "paths": {"a": {"max_abs": "inf"}}}
