"""Deliberately broken targets, each caught by a different contract (proof the contracts can fail),
and targets that fail the way ranks fail: on one rank only, or by hanging."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.targets.base import AttentionSpec, Unsupported
from harness.targets.reference import ReferenceAttention, ReferenceTarget
from harness.targets.reference.pipeline import ReferencePipelineTarget


def one_sided_message(rank: int) -> str:
    return f"rank {rank} cannot build its sequence-parallel layer (a deliberate one-sided failure)"


ONE_SIDED_MESSAGE = one_sided_message(1)


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


class _NoKernel:
    """An attention that forgot to say which kernel runs."""

    backend = "torch_sdpa"

    def __init__(self, inner: ReferenceAttention) -> None:
        self.inner = inner

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.inner(q, k, v, **kwargs)


class _ReturnsWithLse(_Wrapped):
    """Returns ``(out, lse)`` as flash-attn's functions do, instead of the output alone."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        out = self.inner(q, k, v, **kwargs)
        return out, torch.zeros(out.shape[:-1])


class NoKernelTarget(ReferenceTarget):
    name = "no_kernel"

    def make_attention(self, spec: AttentionSpec) -> Any:
        return _NoKernel(super().make_attention(spec))


class ReturnsWithLseTarget(_Target):
    name, wrapper = "returns_with_lse", _ReturnsWithLse


class StringCapabilitiesTarget(ReferenceTarget):
    name = "string_capabilities"

    def capabilities(self) -> Any:
        return "ulysses"


class DiesTarget(ReferenceTarget):
    """The rank process dies while building the layer (a segfault, the OOM killer)."""

    name = "dies"

    def make_attention(self, spec: AttentionSpec) -> ReferenceAttention:
        os._exit(3)


class RaisesOnRankTarget(ReferenceTarget):
    """One rank raises while building the SP layer, before any collective; the others go on into their
    all-to-all and would wait there for it until the timeout."""

    name = "raises_on_rank"

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def make_attention(self, spec: AttentionSpec) -> ReferenceAttention:
        if dist.get_rank() == self.rank and not spec.skip_sequence_parallel:
            raise RuntimeError(one_sided_message(self.rank))
        return super().make_attention(spec)


class SkipsOnRank1Target(ReferenceTarget):
    """Rank 1 alone refuses the SP layer (a refusal must be identical on every rank): the ranks disagree."""

    name = "skips_on_rank_1"

    def make_attention(self, spec: AttentionSpec) -> ReferenceAttention:
        if dist.get_rank() == 1 and not spec.skip_sequence_parallel:
            raise Unsupported("only rank 1 thinks this case cannot run")
        return super().make_attention(spec)


class HangsTarget(ReferenceTarget):
    """Every rank writes its pid into ``marker`` (a directory) and then never returns from building a layer."""

    name = "hangs"

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    def make_attention(self, spec: AttentionSpec) -> ReferenceAttention:
        written = self.marker / f".rank-{dist.get_rank()}.tmp"
        written.write_text(str(os.getpid()))
        written.rename(self.marker / f"rank-{dist.get_rank()}")  # whole or absent: a reader never sees it half written
        while True:
            time.sleep(60)


class RaisesOnRank1Pipeline(ReferencePipelineTarget):
    """The image stage's counterpart: rank 1 raises while preparing; rank 0 goes on into SP set-up."""

    name = "pipeline_raises_on_rank_1"

    def prepare(self, fields: Mapping[str, Any], device: str) -> Any:
        if dist.get_rank() == 1:
            raise RuntimeError(ONE_SIDED_MESSAGE)
        return super().prepare(fields, device)


def perturbed() -> PerturbedTarget:
    return PerturbedTarget()


def nan_output() -> NanTarget:
    return NanTarget()


def swallows_guard() -> SwallowsGuardTarget:
    return SwallowsGuardTarget()


def no_kernel() -> NoKernelTarget:
    return NoKernelTarget()


def returns_with_lse() -> ReturnsWithLseTarget:
    return ReturnsWithLseTarget()


def string_capabilities() -> StringCapabilitiesTarget:
    return StringCapabilitiesTarget()


def dies() -> DiesTarget:
    return DiesTarget()


def raises_on_rank_1() -> RaisesOnRankTarget:
    return RaisesOnRankTarget(1)


def raises_on_rank(rank: str) -> RaisesOnRankTarget:
    return RaisesOnRankTarget(int(rank))


def skips_on_rank_1() -> SkipsOnRank1Target:
    return SkipsOnRank1Target()


def hangs(marker: str) -> HangsTarget:
    return HangsTarget(marker)


def pipeline_raises_on_rank_1() -> RaisesOnRank1Pipeline:
    return RaisesOnRank1Pipeline()
