"""The one-rank padded varlen case and the varlen-under-ring case (cases/contracts/usp.toml) catch what the other
varlen cases miss: a single-rank path that attends to its padding, a refusal of varlen under ring removed
(real gloo groups; the bugs: tests/targets/planted_varlen_bugs.py)."""

from __future__ import annotations

import pytest

from harness.contracts.case import make_case
from harness.contracts.runner import RunOptions, run_cases
from harness.ranks import PoolSet
from harness.results import FAILED, PASSED, SKIPPED, CaseResult
from harness.targets.spec import TargetSpec

PLANTED = "tests.targets.planted_varlen_bugs:factory"
VARLEN = {"dtype": "bf16"}


def _run(pools: PoolSet, target: str, bug: str | None, params: dict) -> CaseResult:
    case = make_case("usp.varlen_parity", {**VARLEN, **params}, case_id="varlen", source="test")
    args = (("bug", bug),) if bug else ()
    [result] = run_cases([case], RunOptions(TargetSpec(target, args), allow_new_skips=True), pools)
    return result


@pytest.mark.parametrize(
    ("bug", "default", "new"),
    [
        ("single_rank_attends_padding", {"world_size": 1}, {"world_size": 1, "seq_lens": [11]}),
        ("ring_varlen_unrefused", {"world_size": 2}, {"world_size": 2, "ring_degree": 2}),
    ],
)
def test_a_varlen_bug_only_the_new_cases_see(rank_pools: PoolSet, bug: str, default: dict, new: dict) -> None:
    before, after = _run(rank_pools, PLANTED, bug, default), _run(rank_pools, PLANTED, bug, new)
    assert before.status == PASSED, before.reason
    assert after.status == FAILED, after.reason


def test_the_reference_refuses_varlen_under_ring_before_any_collective(rank_pools: PoolSet) -> None:
    result = _run(rank_pools, "reference", None, {"world_size": 2, "ring_degree": 2})
    assert result.status == SKIPPED and "seq_lens (varlen) does not support ring parallelism" in result.reason
