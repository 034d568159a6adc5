"""USPAttention under real gloo process groups: parity with one rank, and every guard."""

from __future__ import annotations

import pytest

from harness.launcher import RankPool
from tests.reference import sp_workers as w

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def pool2():
    with RankPool(world_size=2, device="cpu") as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    with RankPool(world_size=4, device="cpu") as pool:
        yield pool


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_sglang_replicated_case_world2(pool2, dtype):
    """B=1, 64 tokens per rank, 30 heads, head dim 128, 6 replicated tokens."""
    for fig in pool2.run(w.replicated_worker, 64, 30, 128, 6, dtype):
        assert fig["suffix"]["bitwise"], fig["suffix"]
        assert fig["prefix_vs_suffix_order"]["max_abs"] <= 1e-2, fig
        assert fig["prefix_vs_prefix_order"]["bitwise"], fig
        assert fig["kv_prefix"]["bitwise"], fig


def test_sglang_replicated_case_world4(pool4):
    for fig in pool4.run(w.replicated_worker, 64, 32, 128, 6, "bf16"):
        assert fig["suffix"]["bitwise"], fig["suffix"]
        assert fig["prefix_vs_suffix_order"]["max_abs"] <= 1e-2, fig
        assert fig["kv_prefix"]["bitwise"], fig


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ulysses_is_bitwise(pool2, dtype, causal, kv_heads):
    for fig in pool2.run(w.parity_worker, 2, 1, 16, 4, kv_heads, 32, dtype, causal):
        assert fig["finite"] and fig["bitwise"], fig


def _fa_rule(fig: dict, k: float = 2.0, floor: float = 1e-5) -> bool:
    """The distributed output is at most k times as far from float64 as one rank is, plus a floor."""
    return fig["finite"] and fig["err64"] <= k * fig["ref_err64"] + floor


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["torch_sdpa", "math"])
def test_ring_matches_by_fa_rule(pool2, dtype, causal, backend):
    for fig in pool2.run(w.parity_worker, 1, 2, 16, 4, 2, 32, dtype, causal, backend):
        assert _fa_rule(fig), fig


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_hybrid_2x2_matches_by_fa_rule(pool4, dtype, causal):
    for fig in pool4.run(w.parity_worker, 2, 2, 8, 4, 2, 32, dtype, causal):
        assert _fa_rule(fig), fig


@pytest.mark.parametrize("seq_lens", [[5, 9], [9, 1], [7, 7]])
def test_varlen_uneven_lengths(pool2, seq_lens):
    for fig in pool2.run(w.varlen_worker, seq_lens, 4, 16, "bf16"):
        assert fig["bitwise"] and fig["padding_zero"], fig


def test_varlen_world4(pool4):
    for fig in pool4.run(w.varlen_worker, [3, 8, 1, 6], 4, 16, "fp32"):
        assert fig["bitwise"] and fig["padding_zero"], fig


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_masked_paths(pool2, dtype):
    for fig in pool2.run(w.masked_worker, 8, 4, 16, dtype):
        assert fig["key_mask"]["bitwise"], fig
        assert fig["full_mask"]["bitwise"], fig


def test_masked_replicated_is_refused_on_every_rank_without_hanging(pool2):
    results = pool2.run(w.guard_worker, "masked_replicated")
    assert all(r.startswith("NotImplementedError") and "replicated" in r for r in results), results


def test_replicated_with_ring_is_refused(pool2):
    results = pool2.run(w.guard_worker, "replicated_with_ring")
    assert all(r.startswith("NotImplementedError") and "ring" in r for r in results), results


def test_ring_admission_requires_lse(pool2):
    results = pool2.run(w.guard_worker, "ring_admission")
    assert all(r.startswith("RuntimeError") and "log-sum-exp" in r for r in results), results


def test_skip_sequence_parallel_runs_locally_without_collectives(pool2):
    results = pool2.run(w.guard_worker, "skip_sp_local")
    assert results[0] == "ran locally, equal=True" and results[1] == "no error", results


def test_heads_not_divisible_by_ulysses_degree(pool2):
    results = pool2.run(w.guard_worker, "heads")
    assert all(r.startswith("ValueError") and "3 query heads" in r and "Ulysses degree 2" in r for r in results)
