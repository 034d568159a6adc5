"""A Ulysses target written from scratch (no reference_impl), and four consistently wrong variants of it
(and one that ignores ``skip_sequence_parallel``, and two correct ones that exchange wastefully).

``NaiveUlyssesTarget`` computes softmax(QKᵀ·scale)V in fp32 and rounds to the input dtype; under
SP it all-to-alls the sequence shards into head shards and back (equal splits, torch.distributed
directly). It is correct, so it must pass ``usp.ulysses_parity``. Each variant carries one bug in
the attention kernel itself, so its single-rank and N-rank outputs share it and agree bitwise:
only the comparison with the float64 oracle can catch it (zeros, ``causal`` ignored, an output
upcast to float64, an output scaled by 1.5).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from harness.targets.base import AttentionSpec, Target, Unsupported

Tensor = torch.Tensor


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> Tensor:
    """fp32 attention on ``[B, S, H, D]``, rounded to the input dtype."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) * scale
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(1, 2).to(q.dtype)


def _seq_to_heads(t: Tensor, world: int) -> Tensor:
    """``[B, S/W, H, D]`` on each rank -> ``[B, S, H/W, D]`` (rank r keeps head block r)."""
    b, s, h, d = t.shape
    send = t.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def _heads_to_seq(t: Tensor, world: int) -> Tensor:
    """``[B, S, H/W, D]`` -> ``[B, S/W, H, D]``: the inverse of :func:`_seq_to_heads`."""
    b, total, hw, d = t.shape
    send = t.reshape(b, world, total // world, hw, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, total // world, world * hw, d)


class NaiveAttention:
    backend = "naive"

    def __init__(self, target: NaiveUlyssesTarget, spec: AttentionSpec, world: int) -> None:
        self.target, self.spec, self.world = target, spec, world
        self.kernel = f"naive fp32 ({target.name})"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
        if kwargs:
            raise Unsupported(f"{self.target.name} takes no {', '.join(sorted(kwargs))}")
        if self.world == 1:
            return self.target.kernel(q, k, v, self.spec)
        q, k, v = self.target.to_heads(q, k, v, self.world)
        return self.target.to_seq(self.target.kernel(q, k, v, self.spec), self.world)


class NaiveUlyssesTarget(Target):
    name = "naive_ulysses"

    def __init__(self) -> None:
        self.degree = 1

    def capabilities(self) -> frozenset[str]:
        return frozenset({"ulysses", "causal"})

    def init_parallel(self, ulysses_degree: int, ring_degree: int) -> None:
        if ring_degree != 1 or ulysses_degree != dist.get_world_size():
            raise Unsupported("naive_ulysses runs Ulysses over the whole group only")
        self.degree = ulysses_degree

    def destroy_parallel(self) -> None:
        self.degree = 1

    def make_attention(self, spec: AttentionSpec) -> NaiveAttention:
        if spec.num_kv_heads not in (None, spec.num_heads):
            raise Unsupported("naive_ulysses has no GQA")
        return NaiveAttention(self, spec, 1 if spec.skip_sequence_parallel else self.degree)

    def kernel(self, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> Tensor:
        return naive_attention(q, k, v, spec.causal, spec.softmax_scale)

    def to_heads(self, q: Tensor, k: Tensor, v: Tensor, world: int) -> tuple[Tensor, ...]:
        """Sequence shards to head shards: one all-to-all per tensor (diffusers' way; sglang packs the three)."""
        return tuple(_seq_to_heads(t, world) for t in (q, k, v))

    def to_seq(self, out: Tensor, world: int) -> Tensor:
        return _heads_to_seq(out, world)


class GathersKVTarget(NaiveUlyssesTarget):
    """Gathers the whole K and V (every head) and keeps its heads, instead of exchanging heads: the same output,
    W times the bytes for K and V."""

    name = "gathers_kv"

    def to_heads(self, q: Tensor, k: Tensor, v: Tensor, world: int) -> tuple[Tensor, ...]:
        heads = k.shape[2] // world
        mine = slice(dist.get_rank() * heads, (dist.get_rank() + 1) * heads)

        def gathered(t: Tensor) -> Tensor:
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            return torch.cat(parts, dim=1)[:, :, mine]

        return _seq_to_heads(q, world), gathered(k), gathered(v)


class PerHeadTarget(NaiveUlyssesTarget):
    """Exchanges W heads at a time (rank r gets head g·W + r of each group g): the same output and bytes in H/W
    calls per tensor instead of one."""

    name = "per_head"

    def to_heads(self, q: Tensor, k: Tensor, v: Tensor, world: int) -> tuple[Tensor, ...]:
        return tuple(torch.cat([_seq_to_heads(g, world) for g in t.split(world, dim=2)], dim=2) for t in (q, k, v))

    def to_seq(self, out: Tensor, world: int) -> Tensor:
        groups = [_heads_to_seq(h, world) for h in out.split(1, dim=2)]  # [B, S/W, W, D] each: heads g·W .. g·W+W-1
        return torch.cat(groups, dim=2)


class IgnoresSkipTarget(NaiveUlyssesTarget):
    """Shards under SP even when asked for the rank-local layer (``skip_sequence_parallel``)."""

    name = "ignores_skip"

    def make_attention(self, spec: AttentionSpec) -> NaiveAttention:
        return NaiveAttention(self, spec, self.degree)


class ZerosTarget(NaiveUlyssesTarget):
    name = "zeros"

    def kernel(self, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> Tensor:
        return torch.zeros_like(q)


class IgnoresCausalTarget(NaiveUlyssesTarget):
    name = "ignores_causal"

    def kernel(self, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> Tensor:
        return naive_attention(q, k, v, False, spec.softmax_scale)


class UpcastsTarget(NaiveUlyssesTarget):
    name = "upcasts"

    def kernel(self, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> Tensor:
        return naive_attention(q.double(), k.double(), v.double(), spec.causal, spec.softmax_scale)


class ScalesTarget(NaiveUlyssesTarget):
    name = "scales"

    def kernel(self, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> Tensor:
        return naive_attention(q, k, v, spec.causal, spec.softmax_scale) * 1.5


def correct() -> NaiveUlyssesTarget:
    return NaiveUlyssesTarget()


def ignores_skip() -> IgnoresSkipTarget:
    return IgnoresSkipTarget()


def zeros() -> ZerosTarget:
    return ZerosTarget()


def ignores_causal() -> IgnoresCausalTarget:
    return IgnoresCausalTarget()


def upcasts() -> UpcastsTarget:
    return UpcastsTarget()


def scales() -> ScalesTarget:
    return ScalesTarget()


def gathers_kv() -> GathersKVTarget:
    return GathersKVTarget()


def per_head() -> PerHeadTarget:
    return PerHeadTarget()
