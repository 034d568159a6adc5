"""The xDiT adapter's refusals, which hold before xfuser is imported (xfuser imports only with an accelerator:
its USP runs in the H200 runs of docs/targets/README.md, not here)."""

from __future__ import annotations

import pytest
import torch

from harness.targets.base import AttentionSpec, Unsupported
from harness.targets.xdit import LACKS, NEEDS_ACCELERATOR, NOT_INSTALLED, RING_OVER_GLOO, SCALE_REFUSED, XditTarget

SPEC = AttentionSpec(num_heads=4, head_dim=16, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("changes", "ring_over_gloo", "reason"),
    [
        ({"num_kv_heads": 2}, False, LACKS["gqa"]),
        ({"softmax_scale": 0.3}, False, SCALE_REFUSED),
        ({}, True, RING_OVER_GLOO),
    ],
    ids=["gqa", "scale", "ring-over-gloo"],
)
def test_what_usp_cannot_take_is_refused_with_xfusers_reason(
    changes: dict[str, object], ring_over_gloo: bool, reason: str
) -> None:
    target = XditTarget()
    target._ring_over_gloo = ring_over_gloo  # what init_parallel records for a ring degree > 1 over gloo
    with pytest.raises(Unsupported) as refused:
        target.make_attention(SPEC.with_(**changes))
    assert refused.value.reason == reason


def test_the_default_scale_and_the_local_reference_under_a_gloo_ring_are_not_refused_before_xfuser() -> None:
    """1/sqrt(d) is USP's own scale, and the rank-local reference never rings: both reach xfuser's import."""
    target = XditTarget()
    target._ring_over_gloo = True
    spec = SPEC.with_(softmax_scale=16**-0.5, skip_sequence_parallel=True)
    try:
        attention = target.make_attention(spec)
    except Unsupported as exc:
        pytest.fail(f"refused: {exc.reason}")
    except (ImportError, NotImplementedError):  # xfuser missing, or without an accelerator (envs.py:138)
        return
    assert attention.backend == "xdit-local"


def test_it_says_why_it_cannot_run_here() -> None:
    assert XditTarget().unavailable_reason("cpu") in (NOT_INSTALLED, NEEDS_ACCELERATOR)
