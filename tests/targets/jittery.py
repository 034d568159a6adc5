"""A target whose kernel is non-deterministic the way atomic reductions are: every call flips the last bit of a
random few elements of its output (and, backward, of dq), different ones each call, unless torch's deterministic
algorithms are on (a kernel with a deterministic mode). With a planted sequence-parallel defect on one rank well
above that jitter, it must still fail: the fallback bound is no silent pass. ``defect=head_variant`` is a
deterministic kernel whose last bits depend on the head count it is called with (a Ulysses rank calls it with
H/W heads), as SDPA's deterministic flash backward was measured to on an H200."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from harness.targets.base import AttentionSpec, Unsupported
from harness.targets.reference import ReferenceAttention, ReferenceTarget
from tests.targets.planting import ScaleGrad

FLIPS = 8  # elements whose last bit flips per call
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def flip_last_bits(t: torch.Tensor, count: int = FLIPS) -> torch.Tensor:
    """``t`` with the lowest mantissa bit of ``count`` random elements flipped (one ulp each), new ones every call;
    ``t`` itself under torch's deterministic algorithms."""
    if torch.are_deterministic_algorithms_enabled():
        return t
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    flat = t.detach().clone().reshape(-1)
    where = torch.randint(flat.numel(), (count,), generator=gen).to(flat.device)
    bits = flat.view(_BITS[t.dtype])
    bits[where] ^= 1
    return flat.view(t.shape)


class _FlipGrad(torch.autograd.Function):
    """Identity forward; backward hands on the gradient with a few last bits flipped (dq's atomics)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return flip_last_bits(grad)


def _error(dtype: torch.dtype) -> float:
    """The planted defect of rank 1 under SP: 1e-4 relative in fp32, 2^-6 (2 to 4 ulps) in bf16 and fp16."""
    return 1e-4 if dtype == torch.float32 else 2.0**-6


def by_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``t`` with the last bit flipped wherever its bits shifted right once are a multiple of ``heads``: the same
    bits for the same value and head count, other bits for another head count."""
    flat = t.detach().clone().reshape(-1)
    bits = flat.view(_BITS[t.dtype])
    bits[(bits >> 1) % heads == 0] ^= 1
    return flat.view(t.shape)


class _Jittery:
    def __init__(self, inner: ReferenceAttention, spec: AttentionSpec, defect: str | None) -> None:
        self.inner, self.spec, self.defect = inner, spec, defect
        self.backend, self.kernel = inner.backend, inner.kernel

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        planted = self.defect is not None and not self.spec.skip_sequence_parallel and dist.get_rank() == 1
        if q.requires_grad and self.defect != "head_variant":
            q = _FlipGrad.apply(q)
            if planted and self.defect == "dq":
                q = ScaleGrad.apply(q, 1 + _error(q.dtype))
        out = self.inner(q, k, v, **kwargs)
        if planted and self.defect == "output":
            out = out * (1 + _error(out.dtype))
        if self.defect == "head_variant":  # the heads its kernel sees: a Ulysses rank's share under SP
            heads = q.shape[2] if self.spec.skip_sequence_parallel else q.shape[2] // dist.get_world_size()
            return out + (by_heads(out, heads) - out).detach()
        return out + (flip_last_bits(out) - out).detach()


class JitteryTarget(ReferenceTarget):
    name = "jittery"

    def __init__(self, defect: str | None = None) -> None:
        self.defect = defect

    def capabilities(self) -> frozenset[str]:
        return super().capabilities() - {"reference_models"}

    def make_attention(self, spec: AttentionSpec) -> _Jittery:  # type: ignore[override]
        few_heads = spec.skip_sequence_parallel and spec.num_heads < 4
        if self.defect == "whole_heads_only" and few_heads:
            raise Unsupported("this layer is built for all 4 heads only")
        if self.defect == "wrong_few_heads" and few_heads:
            return _Jittery(_Scaled(super().make_attention(spec)), spec, None)
        return _Jittery(super().make_attention(spec), spec, self.defect)


class _Scaled:
    """A rank-local layer of fewer heads that computes 1.5 times the attention (wrong, not reordered)."""

    def __init__(self, inner: ReferenceAttention) -> None:
        self.inner, self.backend, self.kernel = inner, inner.backend, inner.kernel

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner(*args, **kwargs) * 1.5


def factory(defect: str | None = None, **_: str) -> JitteryTarget:
    """``defect``: none, ``output`` (rank 1 scales its output under SP), ``dq`` (rank 1 scales its dq) or
    ``head_variant`` (deterministic, its last bits set by the head count instead of at random) or
    ``whole_heads_only`` (a rank-local layer of fewer than 4 heads refused) or ``wrong_few_heads`` (such a layer
    computes 1.5 times the attention)."""
    return JitteryTarget(defect)
