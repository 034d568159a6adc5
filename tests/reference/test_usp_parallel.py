"""USPAttention under real gloo process groups, through the contracts (the one copy of the checks),
plus the layer guards no contract reaches (they are refused before a contract could run them)."""

from __future__ import annotations

import pytest

from harness.results import PASSED
from tests.reference import sp_workers as w

pytestmark = pytest.mark.timeout(240)

SGLANG = dict(batch=1, tokens_per_rank=64, head_dim=128, replicated=6)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_sglang_replicated_case_world2(assert_contract, dtype):
    """B=1, 64 tokens per rank, 30 heads, head dim 128, 6 replicated tokens: suffix bitwise, prefix <= 1e-2."""
    params = dict(SGLANG, world_size=2, heads=30, dtype=dtype)
    assert assert_contract("usp.replicated_suffix_bitwise", **params).figures["bitwise"] is True
    assert assert_contract("usp.replicated_prefix_drift", **params).figures["max_abs"] <= 1e-2
    assert assert_contract("usp.replicated_kv_prefix", **params).figures["bitwise"] is True


def test_sglang_replicated_case_world4(assert_contract):
    params = dict(SGLANG, world_size=4, heads=32, dtype="bf16")
    assert assert_contract("usp.replicated_suffix_bitwise", **params).figures["bitwise"] is True
    assert assert_contract("usp.replicated_prefix_drift", **params).figures["max_abs"] <= 1e-2


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ulysses_is_bitwise(assert_contract, dtype, causal, kv_heads):
    verdict = assert_contract(
        "usp.ulysses_parity", world_size=2, heads=4, kv_heads=kv_heads, head_dim=32, dtype=dtype, causal=causal
    )
    assert verdict.figures["bitwise"] is True


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["torch_sdpa", "math"])
def test_ring_matches_by_fa_rule(assert_contract, dtype, causal, backend):
    verdict = assert_contract(
        "usp.ring_parity", world_size=2, heads=4, kv_heads=2, head_dim=32, dtype=dtype, causal=causal, backend=backend
    )
    assert verdict.figures["err_ref64"] <= verdict.figures["allowed"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_hybrid_2x2_matches_by_fa_rule(assert_contract, dtype, causal):
    verdict = assert_contract(
        "usp.hybrid_parity",
        world_size=4,
        ulysses_degree=2,
        ring_degree=2,
        heads=4,
        kv_heads=2,
        dtype=dtype,
        causal=causal,
    )
    assert verdict.figures["err_ref64"] <= verdict.figures["allowed"]


@pytest.mark.parametrize("world_size, seq_lens", [(2, [5, 9]), (2, [9, 1]), (2, [7, 7]), (4, [3, 8, 1, 6])])
def test_varlen_uneven_lengths(assert_contract, world_size, seq_lens):
    verdict = assert_contract(
        "usp.varlen_parity", world_size=world_size, tokens_per_rank=9, seq_lens=seq_lens, dtype="bf16"
    )
    assert verdict.figures["bitwise"] is True


@pytest.mark.parametrize("mask", ["key_padding", "dense"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_masked_paths(assert_contract, mask, dtype):
    assert assert_contract("usp.masked_parity", world_size=2, mask=mask, dtype=dtype).figures["bitwise"] is True


def test_masked_replicated_is_refused_on_every_rank_without_hanging(assert_contract):
    assert assert_contract("usp.masked_rejects_replicated", world_size=2, replicated=2).status == PASSED


def test_skip_sequence_parallel_runs_locally_without_collectives(assert_contract):
    assert assert_contract("usp.skip_sequence_parallel_local", world_size=2).status == PASSED


@pytest.mark.parametrize(
    ("contract_id", "params"),
    [
        ("usp.replicated_suffix_bitwise", dict(replicated=5)),
        ("usp.replicated_prefix_drift", dict(replicated=5, dtype="bf16")),
        ("usp.replicated_kv_prefix", dict(heads=8, replicated=7)),
    ],
)
def test_replicated_tokens_run_under_ring_within_the_flash_attention_rule(assert_contract, contract_id, params):
    """Replicated K/V is one more LSE block of the ring; the replicated queries' partials merge in rank order."""
    result = assert_contract(contract_id, world_size=2, ring_degree=2, tokens_per_rank=7, head_dim=40, **params)
    assert result.figures["bitwise"] is False  # the ring reorders the reduction: judged by the rule, not bitwise
    assert result.figures["oracle"]["sharded"]["err_ref64"] <= result.figures["oracle"]["sharded"]["allowed"]


def test_ring_admission_requires_lse(rank_pool):
    """On the CPU every backend returns the LSE; pretending SDPA does not exercises the layer's own check."""
    results = rank_pool(2).run(w.guard_worker, "ring_admission")
    assert all(r.startswith("RingAdmissionError") and "log-sum-exp" in r for r in results), results
    from reference_impl.attention.layer import RingAdmissionError

    assert issubclass(RingAdmissionError, RuntimeError)  # what sglang's callers catch


def test_heads_not_divisible_by_ulysses_degree(rank_pool):
    """Case files refuse such heads before a rank runs; the layer must refuse them too."""
    results = rank_pool(2).run(w.guard_worker, "heads")
    assert all(r.startswith("ValueError") and "3 query heads" in r and "Ulysses degree 2" in r for r in results)
