"""TEST-ONLY: the reference target with one named bug planted around every attention call, shared by the planted
bug modules (each gives its bugs and a context manager that puts one in place for the call)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from typing import Any

import torch

from harness.targets.base import AttentionSpec
from harness.targets.reference.attention import ReferenceAttention, ReferenceTarget

Tensor = torch.Tensor
Plant = Callable[[str], AbstractContextManager[Any]]


class PlantedAttention:
    """The reference attention, each call made with the bug in place (a forward builds the autograd graph inside
    it, so the backward keeps a planted Function)."""

    def __init__(self, inner: ReferenceAttention, bug: str, plant: Plant, kind: str) -> None:
        self.inner, self.bug, self.plant = inner, bug, plant
        self.backend = inner.backend
        self.kernel = f"{inner.kernel} [planted {kind} bug: {bug}]"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
        with self.plant(self.bug):
            return self.inner(q, k, v, **kwargs)


class PlantedTarget(ReferenceTarget):
    def __init__(self, bug: str, plant: Plant, kind: str) -> None:
        self.bug, self.plant, self.kind = bug, plant, kind
        self.name = f"planted_{bug}"

    def make_attention(self, spec: AttentionSpec) -> PlantedAttention:  # type: ignore[override]
        return PlantedAttention(super().make_attention(spec), self.bug, self.plant, self.kind)


def planted_target(bug: str, bugs: Collection[str], plant: Plant, kind: str) -> PlantedTarget:
    """The target with ``bug``, one of ``bugs`` (a ValueError lists them)."""
    if bug not in bugs:
        raise ValueError(f"unknown planted bug {bug!r}; valid: {', '.join(bugs)}")
    return PlantedTarget(bug, plant, kind)


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward scales the gradient by ``factor`` (a defect of one path's gradient)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None
