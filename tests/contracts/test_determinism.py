"""A bitwise claim is measured, not assumed: a kernel that differs from itself run to run (last bits flipped at
random, as atomic reductions do) passes by twice its own spread and says so; a defect of one rank well above
that jitter (1e-4 relative in fp32, 2 to 4 ulps in bf16) still fails. Real 2-rank gloo groups."""

from __future__ import annotations

import pytest

from harness.contracts.bounds import HEAD_VARIANT, NON_DETERMINISTIC
from harness.contracts.case import make_case
from harness.contracts.runner import RunOptions, run_cases
from harness.ranks import PoolSet
from harness.results import FAILED, PASSED, CaseResult
from harness.targets.spec import TargetSpec

JITTERY = "tests.targets.jittery:factory"
SHAPE = {"world_size": 2, "tokens_per_rank": 64, "heads": 4, "head_dim": 32}


def _run(pools: PoolSet, contract: str, dtype: str, defect: str | None = None, **params) -> CaseResult:
    case = make_case(contract, {**SHAPE, "dtype": dtype, **params}, case_id="jitter", source="test")
    args = (("defect", defect),) if defect else ()
    [result] = run_cases([case], RunOptions(TargetSpec(JITTERY, args), allow_new_skips=True), pools)
    return result


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("contract", ["usp.ulysses_parity", "usp.ulysses_grad"])
def test_a_non_deterministic_kernel_passes_by_its_own_spread_and_says_so(
    rank_pools: PoolSet, contract: str, dtype: str
) -> None:
    result = _run(rank_pools, contract, dtype)
    jittery = "output" if contract == "usp.ulysses_parity" else "dq"
    determinism = result.figures["determinism"][jittery]
    assert (result.status, result.bound.startswith(NON_DETERMINISTIC), determinism["deterministic"]) == (
        PASSED,
        True,
        False,
    ), result.reason
    assert determinism["differing"] > 0 and determinism["spread_ulps"] >= 1


def test_only_the_gradient_that_jitters_loses_its_bitwise_claim(rank_pools: PoolSet) -> None:
    result = _run(rank_pools, "usp.ulysses_grad", "bf16")
    deterministic = {name: figures["deterministic"] for name, figures in result.figures["determinism"].items()}
    assert deterministic == {"dq": False, "dk": True, "dv": True}
    assert result.bound.endswith("for dq (the rest bitwise)")
    assert (result.figures["dk"]["bitwise"], result.figures["dv"]["bitwise"]) == (True, True)


@pytest.mark.parametrize(
    ("contract", "dtype", "defect", "words"),
    [
        ("usp.ulysses_parity", "fp32", "output", "ulp (max abs"),
        ("usp.ulysses_parity", "bf16", "output", "ulp (max abs"),
        ("usp.ulysses_grad", "fp32", "dq", "dq: "),
        ("usp.ulysses_grad", "bf16", "dq", "dq: "),
    ],
)
def test_a_defect_above_the_jitter_still_fails(
    rank_pools: PoolSet, contract: str, dtype: str, defect: str, words: str
) -> None:
    result = _run(rank_pools, contract, dtype, defect)
    assert result.status == FAILED and words in result.reason and NON_DETERMINISTIC in result.reason, result.reason


def test_a_deterministic_kernel_is_measured_and_stays_bitwise(assert_contract) -> None:
    result = assert_contract("usp.ulysses_grad", **SHAPE)
    assert {name: f["deterministic"] for name, f in result.figures["determinism"].items()} == dict.fromkeys(
        ("dq", "dk", "dv"), True
    )
    assert result.bound.startswith("bitwise")


def test_a_bound_that_claims_no_bitwise_measures_nothing(assert_contract) -> None:
    assert "determinism" not in assert_contract("usp.ring_parity", **SHAPE).figures


@pytest.mark.parametrize("contract", ["usp.ulysses_parity", "usp.ulysses_grad"])
def test_deterministic_true_puts_the_targets_calls_and_backward_in_torchs_deterministic_mode(
    rank_pools: PoolSet, contract: str
) -> None:
    """The jittery kernel stops flipping bits under torch's deterministic algorithms: bitwise again, forward and
    backward (the backward runs in the mode too), while the oracles run outside it."""
    result = _run(rank_pools, contract, "bf16", deterministic=True)
    deterministic = {name: figures["deterministic"] for name, figures in result.figures["determinism"].items()}
    assert (result.status, result.bound.startswith("bitwise"), set(deterministic.values())) == (PASSED, True, {True})


def test_a_computation_without_a_deterministic_implementation_is_refused_not_failed() -> None:
    import torch

    from harness.contracts.registry import deterministic_algorithms
    from harness.targets.base import Unsupported

    before = torch.are_deterministic_algorithms_enabled()
    with pytest.raises(Unsupported, match="asked for deterministic algorithms"), deterministic_algorithms():
        raise RuntimeError("scatter_add_cuda_kernel does not have a deterministic implementation")
    assert torch.are_deterministic_algorithms_enabled() == before


def test_a_kernel_whose_bits_follow_the_head_count_is_said_so_and_judged_by_that_spread(rank_pools: PoolSet) -> None:
    """Deterministic run to run, but a Ulysses rank's head group differs from all heads at once: the head-group
    run shows it, and bitwise is not claimed for it (SDPA's deterministic flash backward on an H200)."""
    result = _run(rank_pools, "usp.ulysses_parity", "bf16", "head_variant")
    output = result.figures["determinism"]["output"]
    assert (result.status, output["deterministic"], output["head_groups"]["invariant"]) == (PASSED, True, False)
    assert result.bound.startswith(HEAD_VARIANT) and NON_DETERMINISTIC not in result.bound


def test_a_target_that_cannot_build_a_head_groups_layer_still_runs_the_case_and_says_so(rank_pools: PoolSet) -> None:
    """The head-group run is a measurement, not a requirement: refused, it is left out, the result says why."""
    result = _run(rank_pools, "usp.ulysses_parity", "fp32", "whole_heads_only")
    determinism = result.figures["determinism"]
    assert (result.status, "head_groups" in determinism["output"]) == (PASSED, False)
    assert determinism["unmeasured"].startswith("head groups not measured: the target refused a 2-head layer")


@pytest.mark.parametrize("contract", ["usp.ulysses_parity", "usp.ulysses_grad"])
def test_a_head_group_run_that_is_wrong_fails_instead_of_widening_the_bound(rank_pools: PoolSet, contract: str) -> None:
    """The extra runs face float64 attention too: a layer wrong for fewer heads (1.5 times the attention) cannot
    turn its distance into the fallback bound of the sharded comparison."""
    result = _run(rank_pools, contract, "bf16", "wrong_few_heads")
    assert result.status == FAILED and "head-group" in result.reason and "vs float64 attention" in result.reason, (
        result.reason
    )


def test_the_extra_runs_are_judged_against_float64_and_reported(rank_pools: PoolSet) -> None:
    result = _run(rank_pools, "usp.ulysses_grad", "bf16", "head_variant")
    oracle = result.figures["oracle"]
    judged = {key for key in oracle if key.startswith(("single-rank repeat", "head-group"))}
    assert judged == {f"{role} {n}" for role in ("single-rank repeat", "head-group") for n in ("dq", "dk", "dv")}
    assert all(oracle[key]["err_ref64"] <= oracle[key]["allowed"] for key in judged), oracle


def test_replicated_copies_of_a_non_deterministic_kernel_are_not_claimed_alike_under_any_bound(
    rank_pools: PoolSet,
) -> None:
    """A hybrid's ring positions compute their own copy of the replicated tokens' dq: under the FA rule (a ring)
    too, a kernel that differs from itself cannot keep them bit-identical (FA4's default backward on an H200)."""
    hybrid = {"world_size": 4, "ring_degree": 2, "heads": 8, "kv_heads": 4, "replicated": 3}
    result = _run(rank_pools, "usp.replicated_suffix_grad", "bf16", **hybrid)
    assert result.status == PASSED, result.reason
    assert result.figures["determinism"]["dq"]["deterministic"] is False
    assert result.figures["replicated_alike_not_claimed"] == {"dq": NON_DETERMINISTIC}


def test_replicated_copies_of_a_deterministic_kernel_stay_claimed_alike(assert_contract) -> None:
    result = assert_contract(
        "usp.replicated_suffix_grad", **{**SHAPE, "world_size": 4, "ring_degree": 2, "replicated": 3}
    )
    assert result.figures["determinism"]["dq"]["deterministic"] is True
    assert "replicated_alike_not_claimed" not in result.figures
