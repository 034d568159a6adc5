"""Deliberately broken targets, each caught by a different contract (proof the contracts can fail)."""

from __future__ import annotations

import os
from typing import Any

import torch

from harness.targets.base import AttentionSpec, Unsupported
from harness.targets.reference import ReferenceAttention, ReferenceTarget


class _Wrapped:
    def __init__(self, inner: ReferenceAttention, spec: AttentionSpec) -> None:
        self.inner, self.spec = inner, spec
        self.backend, self.kernel = inner.backend, inner.kernel


class _PerturbedUnderSP(_Wrapped):
    """Adds a small deterministic error to sequence-parallel outputs (not to the local reference)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = self.inner(q, k, v, **kwargs)
        if self.spec.skip_sequence_parallel:
            return out
        return out + self.error(out)

    def error(self, out: torch.Tensor) -> torch.Tensor:
        return torch.full_like(out, 0.05)


class _NanUnderSP(_PerturbedUnderSP):
    def error(self, out: torch.Tensor) -> torch.Tensor:
        err = torch.zeros_like(out)
        err.view(-1)[0] = float("nan")
        return err


class _SwallowsGuard(_Wrapped):
    """Hides the masked+replicated refusal by dropping the replicated count."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        try:
            return self.inner(q, k, v, **kwargs)
        except Unsupported:
            for key in ("num_replicated_prefix", "num_replicated_suffix", "num_replicated_kv_prefix"):
                kwargs.pop(key, None)
            return self.inner(q, k, v, **kwargs)


class _Target(ReferenceTarget):
    wrapper: type[_Wrapped]

    def capabilities(self) -> frozenset[str]:
        return super().capabilities() - {"reference_models"}  # the reference models would not use this attention

    def make_attention(self, spec: AttentionSpec) -> _Wrapped:  # type: ignore[override]
        return self.wrapper(super().make_attention(spec), spec)


class PerturbedTarget(_Target):
    name, wrapper = "perturbed", _PerturbedUnderSP


class NanTarget(_Target):
    name, wrapper = "nan_output", _NanUnderSP


class SwallowsGuardTarget(_Target):
    name, wrapper = "swallows_guard", _SwallowsGuard


class DiesTarget(ReferenceTarget):
    """The rank process dies while building the layer (a segfault, the OOM killer)."""

    name = "dies"

    def make_attention(self, spec: AttentionSpec) -> ReferenceAttention:
        os._exit(3)


def perturbed() -> PerturbedTarget:
    return PerturbedTarget()


def nan_output() -> NanTarget:
    return NanTarget()


def swallows_guard() -> SwallowsGuardTarget:
    return SwallowsGuardTarget()


def dies() -> DiesTarget:
    return DiesTarget()
