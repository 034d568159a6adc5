"""The float64 oracle in every attention contract catches what self-comparison cannot: a bug that the
one-rank and the N-rank path share (real 2-rank gloo groups, a from-scratch Ulysses target)."""

from __future__ import annotations

import pytest
import torch

from harness.contracts.bounds import FlashAttentionRule
from harness.contracts.case import make_case
from harness.contracts.oracles import Asked, attention_ref64, diagnose, take
from harness.contracts.runner import RunOptions, run_cases
from harness.ranks import PoolSet
from harness.results import FAILED, NOT_APPLICABLE, PASSED, CaseResult
from harness.targets.spec import TargetSpec

pytestmark = pytest.mark.timeout(300)
NAIVE = "tests.targets.naive_ulysses"


def _ulysses(pools: PoolSet, target: str, **params) -> CaseResult:
    case = make_case("usp.ulysses_parity", {"world_size": 2, **params}, case_id="u", source="test")
    [result] = run_cases([case], RunOptions(TargetSpec(f"{NAIVE}:{target}"), allow_new_skips=True), pools)
    return result


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_correct_naive_ulysses_passes(rank_pools: PoolSet, dtype: str, causal: bool) -> None:
    result = _ulysses(rank_pools, "correct", dtype=dtype, causal=causal)
    assert result.status == PASSED, result.reason
    assert result.figures["bitwise"] is True
    oracle = result.figures["oracle"]
    outputs = ("sharded", "single-rank")
    assert {o: 0 < oracle[o]["err_ref64"] <= oracle[o]["allowed"] for o in outputs} == dict.fromkeys(outputs, True), (
        oracle
    )


@pytest.mark.parametrize(
    ("target", "params", "words"),
    [
        ("zeros", {}, "the output is all zeros"),
        ("ignores_causal", {"causal": True}, "it ignores causal"),
        ("scales", {}, "it is 1.5 times the attention"),
        ("scales", {"dtype": "bf16", "causal": True}, "it is 1.5 times the attention"),
    ],
)
def test_a_consistently_wrong_target_fails_and_says_how(
    rank_pools: PoolSet, target: str, params: dict, words: str
) -> None:
    result = _ulysses(rank_pools, target, **params)
    assert result.status == FAILED
    assert result.figures["bitwise"] is True  # one rank and two agree: only the oracle sees the bug
    assert "sharded output vs float64 attention" in result.reason and "single-rank output vs float64" in result.reason
    assert words in result.reason


def test_ignoring_causal_is_invisible_without_causal(rank_pools: PoolSet) -> None:
    assert _ulysses(rank_pools, "ignores_causal", causal=False).status == PASSED


def test_an_upcast_output_fails_on_its_dtype(rank_pools: PoolSet) -> None:
    result = _ulysses(rank_pools, "upcasts", dtype="bf16")
    assert result.status == FAILED
    assert "sharded output dtype is torch.float64, the input's is torch.bfloat16" in result.reason
    assert "single-rank output dtype is torch.float64" in result.reason


def test_the_reference_reports_its_distance_to_the_oracle(assert_contract) -> None:
    result = assert_contract("usp.replicated_suffix_bitwise", world_size=2, heads=4, replicated=3, dtype="bf16")
    oracle = result.figures["oracle"]
    assert oracle["bound"].startswith("max|out − ref64| ≤ 2·max|naive_bf16 − ref64|")
    assert oracle["sharded"]["err_ref64"] <= oracle["sharded"]["allowed"]


def test_diagnose_names_an_ignored_mask_and_nothing_for_noise() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 8, generator=gen) for _ in range(3))
    mask = torch.rand(1, 12, generator=gen) > 0.5
    mask[:, 0] = True
    rule = FlashAttentionRule(2.0, 1e-6, "fp32")
    unmasked = attention_ref64(q, k, v).float()
    assert (
        diagnose(unmasked, Asked(q, k, v, mask=mask), None, rule)
        == "it ignores the attention mask: it matches unmasked attention"
    )
    rows = torch.tensor([7, 2, -1])  # a rank's rows in its order, one of them padding
    assert (
        diagnose(take(unmasked, rows), Asked(q, k, v, mask=mask), rows, rule)
        == "it ignores the attention mask: it matches unmasked attention"
    )
    noise = torch.randn(1, 12, 2, 8, generator=gen)
    assert diagnose(noise, Asked(q, k, v, mask=mask), None, rule) is None


@pytest.mark.parametrize("oracle", ["garbage", "bitwise", "abs:1", "fa:-1"])
def test_an_oracle_that_is_not_the_flashattention_rule_is_refused_at_config_time(oracle: str) -> None:
    from harness.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        make_case("usp.ulysses_parity", {"world_size": 2, "oracle": oracle}, case_id="u", source="f.toml")
    assert info.value.key == "cases.u.oracle"


def test_under_a_flashattention_bound_the_failure_is_said_once_with_the_oracles_hint(rank_pools: PoolSet) -> None:
    """bound = fa (the oracle's own rule): the sharded output is judged against float64 by the case's bound;
    the oracle adds its diagnosis, not the same number a second time."""
    result = _ulysses(rank_pools, "scales", bound="fa")
    assert result.status == FAILED
    assert result.reason.count("max|out − ref64|") == 2  # the case's bound (sharded) and the single-rank oracle
    assert "sharded output vs float64 attention" not in result.reason
    assert "sharded output: it is 1.5 times the attention" in result.reason


@pytest.mark.parametrize("target", ["correct", "ignores_skip"])
def test_every_sequence_parallel_target_is_held_to_skip_sequence_parallel(rank_pools: PoolSet, target: str) -> None:
    """The shipped Ulysses cases run on a Ulysses-only target; one that shards the rank-local layer fails them."""
    from harness.cases.contract import load_cases
    from harness.paths import default_cases_dir

    cases = [c for c in load_cases(default_cases_dir()) if c.contract_id == "usp.skip_sequence_parallel_local"]
    results = run_cases(cases, RunOptions(TargetSpec(f"{NAIVE}:{target}"), allow_new_skips=True), rank_pools)
    ran = {r.case_id: r.status for r in results if r.status != NOT_APPLICABLE}
    assert set(ran) == {"skip_sequence_parallel_local[world_size=2]", "skip_sequence_parallel_local[world_size=4]"}
    assert {r.case_id for r in results if r.status == NOT_APPLICABLE} == {  # no ring declared
        "skip_sequence_parallel_local_ring",
        "skip_sequence_parallel_local_hybrid",
    }
    assert set(ran.values()) == ({PASSED} if target == "correct" else {FAILED}), results
