"""Perf contracts (ratios timed side by side) on real ranks: the figures are there, and a planted
slowdown far beyond the bound fails (margins are wide: this asserts the check, not a speed)."""

from __future__ import annotations

import pytest

from harness.contracts.case import make_case
from harness.contracts.runner import RunOptions, run_cases
from harness.ranks import PoolSet
from harness.results import FAILED, PASSED
from harness.targets.spec import TargetSpec

pytestmark = pytest.mark.timeout(600)
SMALL = {"tokens": 256, "heads": 4, "head_dim": 32, "repeats": 2, "min_run_time": 0.1}


def _one(pools: PoolSet, contract: str, target: str = "reference", **params):
    [result] = run_cases(
        [make_case(contract, params, case_id=contract, source="test")],
        RunOptions(TargetSpec(target), allow_new_skips=True),
        pools,
    )
    return result


def test_attention_overhead_measures_both_sides_and_catches_a_planted_slowdown(rank_pools: PoolSet) -> None:
    fine = _one(rank_pools, "perf.attention_overhead", max_overhead=10.0, **SMALL)
    assert fine.status == PASSED and fine.figures["raw_sdpa_ms"] > 0 and fine.figures["attention_ms"] > 0
    assert fine.figures["limit"] == 11.0
    slow = _one(
        rank_pools, "perf.attention_overhead", "tests.targets.slow_attention:factory", max_overhead=0.5, **SMALL
    )
    assert slow.status == FAILED and slow.figures["ratio"] > 1.5  # the sleep makes the call 5x as long
    assert "the target's attention is" in slow.reason and "limit 1.5×" in slow.reason


def test_sp_step_ratio_times_both_layouts_on_the_same_ranks(rank_pools: PoolSet) -> None:
    result = _one(
        rank_pools, "perf.sp_step_ratio", world_size=2, height=32, width=32, steps=2, repeats=1, max_ratio=1e-6
    )
    assert result.status == FAILED  # nothing runs at a millionth of one rank's step: the bound is applied
    assert result.figures["steps_timed"] == 2 and result.figures["single_rank_step_ms"] > 0
    assert result.figures["ratio"] == pytest.approx(
        result.figures["sp_step_ms"] / result.figures["single_rank_step_ms"]
    )
