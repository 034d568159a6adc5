"""A reference target whose attention sleeps four times as long as it computes, and at least 20 ms a call: a
planted slowdown of 5x or more (a busy machine, which can slow one side of the timing more than the other, hid
the 5x alone once, at load ~4 on 2 cores; load stretches compute, never the floor)."""

from __future__ import annotations

import time
from typing import Any

import torch

from harness.targets.base import AttentionSpec
from harness.targets.reference import ReferenceAttention, ReferenceTarget


class SlowAttention:
    def __init__(self, inner: ReferenceAttention) -> None:
        self.inner, self.backend, self.kernel = inner, inner.backend, f"{inner.kernel}, slowed down"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner(q, k, v, **kwargs)
        time.sleep(max(4 * (time.perf_counter() - start), 0.02))
        return out


class SlowTarget(ReferenceTarget):
    name = "slow_attention"

    def make_attention(self, spec: AttentionSpec) -> SlowAttention:  # type: ignore[override]
        return SlowAttention(super().make_attention(spec))


def factory() -> SlowTarget:
    return SlowTarget()
