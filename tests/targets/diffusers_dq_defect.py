"""TEST-ONLY: the diffusers target with a second defect inside its known ring-backward divergence: under ring
attention rank 1 scales its dq by 1 + 2^-2 (dk and dv untouched). ``ring_grad_w4[causal=false]`` is expected to
fail for dk and dv (the overlay's upstream bug); this must not hide in that expectation."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.targets.base import AttentionSpec
from harness.targets.diffusers import DiffusersTarget
from tests.targets.planting import ScaleGrad


class _DqDefect:
    def __init__(self, inner: Any, spec: AttentionSpec) -> None:
        self.inner, self.spec = inner, spec
        self.backend, self.kernel = inner.backend, inner.kernel + " [test-only: rank 1 scales its dq by 1.25]"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if q.requires_grad and not self.spec.skip_sequence_parallel and dist.get_rank() == 1:
            q = ScaleGrad.apply(q, 1.25)
        return self.inner(q, k, v, **kwargs)


class DqDefectTarget(DiffusersTarget):
    name = "diffusers_dq_defect"
    overlay = "diffusers"

    def make_attention(self, spec: AttentionSpec) -> _DqDefect:  # type: ignore[override]
        return _DqDefect(super().make_attention(spec), spec)


def factory() -> DqDefectTarget:
    return DqDefectTarget()
