"""Replicated tokens' outputs and gradients must be the same on every rank, bit for bit, unless the kernel was
measured non-deterministic at the shape: ranks that compute their own copy (a hybrid's ring positions) then differ
by its jitter, as FA4's default dq did on an H200 (zimage_1024_hybrid_grad_w4), and each copy is judged by the
jitter bound and float64 instead. With a deterministic kernel a copy that differs still fails."""

from __future__ import annotations

import pytest
import torch

from harness.contracts.bounds import NON_DETERMINISTIC, AbsBound, Bitwise, Bound
from harness.contracts.judging import Against, Comparison, RankOutcome, verdict
from harness.contracts.stats import compare, digest, magnitude_floor
from harness.results import FAILED, PASSED

_REF = torch.linspace(-2, 2, 64, dtype=torch.float32).to(torch.bfloat16)


def _one_ulp_apart(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.int16) ^ 1).view(torch.bfloat16)


def _rank(copy: torch.Tensor, jitters: bool) -> RankOutcome:
    """One rank's dq: its replicated copy against the single-rank dq, and the single-rank dq run again."""
    floor = magnitude_floor(_REF)
    again = _one_ulp_apart(_REF) if jitters else _REF
    return RankOutcome(
        [
            Comparison(Against.REFERENCE, "dq", compare(copy, _REF, ulps_above=floor)),
            Comparison(Against.REPEAT, "dq", compare(again, _REF, ulps_above=floor)),
        ],
        replicated={"dq": digest(copy)},
        checks=1,
    )


@pytest.mark.parametrize("bound", [Bitwise(), AbsBound(0.05)], ids=["bitwise", "abs"])
def test_copies_differing_by_a_non_deterministic_kernels_jitter_pass_and_say_so(bound: Bound) -> None:
    judged = verdict(bound, None, [_rank(_REF, jitters=True), _rank(_one_ulp_apart(_REF), jitters=True)])
    assert judged.status == PASSED, judged.reason
    assert judged.figures["replicated_alike_not_claimed"] == {"dq": NON_DETERMINISTIC}


def test_copies_that_differ_under_a_deterministic_kernel_fail() -> None:
    judged = verdict(Bitwise(), None, [_rank(_REF, jitters=False), _rank(_REF, jitters=False)])
    assert judged.status == PASSED and "replicated_alike_not_claimed" not in judged.figures
    ranks = [_rank(_REF, jitters=False), _rank(_REF, jitters=False)]
    ranks[1].replicated["dq"] = digest(_one_ulp_apart(_REF))
    judged = verdict(Bitwise(), None, ranks)
    assert (
        judged.status == FAILED and "the replicated dq is not the same on every rank: rank 1 differs" in judged.reason
    )


def test_a_copy_beyond_the_jitter_still_fails() -> None:
    wrong = _REF * 1.01
    judged = verdict(Bitwise(), None, [_rank(_REF, jitters=True), _rank(wrong, jitters=True)])
    assert judged.status == FAILED and "dq" in judged.reason
