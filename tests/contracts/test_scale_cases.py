"""The softmax-scale and large-logit cases (cases/contracts/scale.toml) catch what every default case misses: a
ring that drops the scale, an LSE path that drops it, a merge without the max shift (real 2-rank gloo groups;
the bugs: tests/targets/planted_ring_bugs.py)."""

from __future__ import annotations

import pytest

from harness.contracts.case import make_case
from harness.contracts.runner import RunOptions, run_cases
from harness.ranks import PoolSet
from harness.results import FAILED, PASSED, CaseResult
from harness.targets.spec import TargetSpec

PLANTED = "tests.targets.planted_ring_bugs:factory"
RING = {"world_size": 2, "dtype": "fp32"}
SCALED = {**RING, "softmax_scale": 0.3}
LARGE_LOGITS = {**RING, "head_dim": 64, "softmax_scale": 8.0}


def _run(pools: PoolSet, bug: str, params: dict) -> CaseResult:
    case = make_case("usp.ring_parity", params, case_id="ring", source="test")
    [result] = run_cases([case], RunOptions(TargetSpec(PLANTED, (("bug", bug),))), pools)
    return result


@pytest.mark.parametrize(
    ("bug", "params", "words"),
    [
        ("ring_ignores_scale", SCALED, "it ignores the softmax scale 0.3: it matches the default 1/√d"),
        ("lse_drops_scale", SCALED, "it ignores the softmax scale 0.3: it matches the default 1/√d"),
        ("unsafe_merge", LARGE_LOGITS, "non-finite"),
    ],
)
def test_a_ring_bug_only_the_new_cases_see(rank_pools: PoolSet, bug: str, params: dict, words: str) -> None:
    default, new = _run(rank_pools, bug, RING), _run(rank_pools, bug, params)
    assert default.status == PASSED, default.reason  # every default case passes with the bug
    assert new.status == FAILED and words in new.reason, new.reason


def test_the_large_logit_cases_reach_lses_past_fp32s_exp_limit() -> None:
    """Scores of scale 8 on d = 64 randn inputs: a 16-key block's LSE passes 88.7 (exp overflows fp32) in most rows."""
    import torch

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 32, 64, generator=gen), torch.randn(1, 4, 16, 64, generator=gen)
    lse = torch.logsumexp(8.0 * q @ k.transpose(-1, -2), dim=-1)
    assert (lse > 88.7).float().mean() > 0.5 and lse.max() > 140  # measured: 70 %, up to 152
