"""A deliberately broken target: sglang's old replicated-suffix path.

It rotates the replicated suffix to the front and runs the replicated-prefix path, then rotates
the output back. Mathematically the same attention, but every query now scans K/V in a
different order, so in bf16 the output is no longer bitwise equal to one rank (Z-Image-Turbo
drifted by MAE 7.28 over 9 steps this way). ``usp.replicated_suffix_bitwise`` must catch it,
while ``usp.replicated_prefix_drift`` (which this target leaves alone) still passes.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.targets.base import AttentionSpec
from harness.targets.reference import ReferenceAttention, ReferenceTarget


class RotatingSuffixAttention:
    def __init__(self, inner: ReferenceAttention) -> None:
        self.inner = inner
        self.backend = inner.backend
        self.kernel = f"{inner.kernel}, suffix rotated to the front"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        n = kwargs.pop("num_replicated_suffix", 0)
        if not n:
            return self.inner(q, k, v, **kwargs)
        to_front = [torch.cat([t[:, -n:], t[:, :-n]], dim=1) for t in (q, k, v)]
        out = self.inner(*to_front, num_replicated_prefix=n, **kwargs)
        return torch.cat([out[:, n:], out[:, :n]], dim=1)


class RotatingSuffixTarget(ReferenceTarget):
    name = "rotating_suffix"

    def capabilities(self) -> frozenset[str]:
        return super().capabilities() - {"reference_models"}  # the reference models would not use this attention

    def make_attention(self, spec: AttentionSpec) -> RotatingSuffixAttention:  # type: ignore[override]
        return RotatingSuffixAttention(super().make_attention(spec))


def factory() -> RotatingSuffixTarget:
    return RotatingSuffixTarget()
