"""Gradient contracts (usp.*_grad) on real gloo groups: the reference passes them, and a bug planted in
one backward (tests/targets/planted_grad_bugs.py) fails them while every forward contract still passes."""

from __future__ import annotations

import pytest

from harness.contracts.case import make_case
from harness.contracts.runner import RunOptions, run_cases
from harness.ranks import PoolSet
from harness.results import FAILED, PASSED, CaseResult
from harness.targets.spec import TargetSpec

pytestmark = pytest.mark.timeout(300)
SMALL = dict(tokens_per_rank=7, head_dim=40)  # as cases/contracts/usp_grad.toml


def _run(pools: PoolSet, contract_id: str, bug: str | None = None, **params) -> CaseResult:
    target = "tests.targets.planted_grad_bugs:factory" if bug else "reference"
    args = (("bug", bug),) if bug else ()
    case = make_case(contract_id, {**SMALL, **params}, case_id=contract_id, source="test")
    [result] = run_cases([case], RunOptions(TargetSpec(target, args), allow_new_skips=True), pools)
    return result


@pytest.mark.parametrize(
    ("contract_id", "params", "bitwise"),
    [
        ("usp.ulysses_grad", dict(world_size=2, dtype="bf16", causal=True), True),
        ("usp.ring_grad", dict(world_size=2, dtype="fp32", causal=True), False),
        ("usp.replicated_suffix_grad", dict(world_size=2, ring_degree=2, replicated=5, dtype="bf16"), False),
    ],
)
def test_the_reference_passes_by_its_bound_and_the_oracle(
    rank_pools: PoolSet, contract_id: str, params: dict, bitwise: bool
) -> None:
    result = _run(rank_pools, contract_id, **params)
    assert result.status == PASSED, result.reason
    assert result.figures["bitwise"] is bitwise
    oracle = result.figures["oracle"]
    outputs = ("sharded dq", "sharded dk", "sharded dv")
    within = {name: 0 < oracle[name]["err_ref64"] <= oracle[name]["allowed"] for name in outputs}
    assert within == dict.fromkeys(outputs, True), oracle  # measured against float64, within the rule


@pytest.mark.parametrize(
    ("bug", "contract_id", "params", "wrong"),
    [
        # the remote K/V blocks' dk, dv never travel back; dq (local queries) stays right
        ("ring_detached", "usp.ring_grad", dict(world_size=2, dtype="fp32"), ("dk", "dv")),
        # the ring's adjoint shift goes forward: invisible at W=2 (next = previous), caught at W=4
        ("ring_same_direction", "usp.ring_grad", dict(world_size=4, dtype="bf16"), ("dk", "dv")),
        # the output all-to-all's adjoint divides by the Ulysses degree: every gradient halved
        ("ulysses_averaged", "usp.ulysses_grad", dict(world_size=2, dtype="bf16"), ("dq", "dk", "dv")),
    ],
)
def test_a_planted_backward_bug_fails_the_gradient_contract(
    rank_pools: PoolSet, bug: str, contract_id: str, params: dict, wrong: tuple[str, ...]
) -> None:
    result = _run(rank_pools, contract_id, bug, **params)
    assert result.status == FAILED, result.reason
    assert f"[planted backward bug: {bug}]" in result.kernel
    oracle = result.figures["oracle"]
    far = {
        name: oracle[f"sharded {name}"]["err_ref64"] > 10 * oracle[f"sharded {name}"]["allowed"]
        for name in ("dq", "dk", "dv")
    }
    assert far == {name: name in wrong for name in ("dq", "dk", "dv")}, oracle
    forward = "usp.ring_parity" if bug.startswith("ring") else "usp.ulysses_parity"
    assert _run(rank_pools, forward, bug, **params).status == PASSED  # the forward is untouched


def test_a_ring_shift_sent_onwards_is_invisible_at_two_ranks(rank_pools: PoolSet) -> None:
    assert _run(rank_pools, "usp.ring_grad", "ring_same_direction", world_size=2, dtype="bf16").status == PASSED


def test_the_averaged_ulysses_gradient_is_diagnosed_as_scaled(rank_pools: PoolSet) -> None:
    result = _run(rank_pools, "usp.ulysses_grad", "ulysses_averaged", world_size=2, dtype="fp32")
    assert result.figures["bitwise"] is False
    assert "0.5 times" in result.reason, result.reason
