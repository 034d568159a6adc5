"""Sequence-parallel defects planted in the reference layer, for checks at any length (the GPU's 119k tokens too):
``rank_order`` hands every rank its neighbour's output (shards gathered in the wrong rank order), ``scaled_rank``
scales rank 1's output by 1 + 2^-4 (6 %, beyond the FlashAttention rule's bf16 allowance at any length),
``one_head`` scales head 1 of every rank's output by as much (a head-order or GQA-mapping bug reads like that).
Single-rank calls are untouched."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.targets.base import AttentionSpec
from harness.targets.reference import ReferenceAttention, ReferenceTarget

DEFECTS = ("rank_order", "scaled_rank", "one_head")


class _Planted:
    def __init__(self, inner: ReferenceAttention, spec: AttentionSpec, defect: str) -> None:
        self.inner, self.spec, self.defect = inner, spec, defect
        self.backend, self.kernel = inner.backend, inner.kernel

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = self.inner(q, k, v, **kwargs)
        if self.spec.skip_sequence_parallel:
            return out
        rank, world = dist.get_rank(), dist.get_world_size()
        if self.defect == "scaled_rank":
            return out * (1 + 2.0**-4) if rank == 1 else out
        if self.defect == "one_head":
            scale = torch.ones(out.shape[2], dtype=out.dtype, device=out.device)
            return out * scale.index_fill(0, torch.tensor([1], device=out.device), 1 + 2.0**-4)[:, None]
        shards = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(shards, out.detach().contiguous())
        return out + (shards[(rank + 1) % world] - out).detach()


class PlantedTarget(ReferenceTarget):
    name = "planted_sp"

    def __init__(self, defect: str) -> None:
        if defect not in DEFECTS:
            raise ValueError(f"defect must be one of {', '.join(DEFECTS)}, got {defect!r}")
        self.defect = defect

    def capabilities(self) -> frozenset[str]:
        return super().capabilities() - {"reference_models"}

    def make_attention(self, spec: AttentionSpec) -> _Planted:  # type: ignore[override]
        return _Planted(super().make_attention(spec), spec, self.defect)


def factory(defect: str = "rank_order", **_: str) -> PlantedTarget:
    return PlantedTarget(defect)
