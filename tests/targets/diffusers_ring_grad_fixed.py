"""TEST-ONLY: the diffusers target with its ring backward's dK/dV accumulators sent to rank - 1, not rank + 1.

``TemplatedRingAttention.backward`` (diffusers 0.42.1, attention_dispatch.py:2481-2529) adds at
iteration i the gradient of K/V chunk r + i to the accumulator it received, and sends it on with
``funcol.permute_tensor(buf, next_ranks)``, ``next_ranks[r] = r + 1``. The accumulator of chunk
r + i + 1 is then on rank r + 1, so it must travel to rank r - 1, not r + 1 (at ring degree 2 the
two coincide). Inverting the permutation while a case runs is the whole fix: if the
overlay's expected failure ``ring_grad_w4[causal=false]`` is that bug, this target passes it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import _functional_collectives as funcol

from harness.targets.base import AttentionSpec
from harness.targets.diffusers import DiffusersAttention, DiffusersTarget

_permute = funcol.permute_tensor


def _inverse_permute(tensor: torch.Tensor, src_dst: list[int], group: Any = None, **kwargs: Any) -> torch.Tensor:
    """``permute_tensor`` with every send reversed: rank m sends to the rank that sent to it."""
    inverse = [0] * len(src_dst)
    for src, dst in enumerate(src_dst):
        inverse[dst] = src
    return _permute(tensor, inverse, group=group, **kwargs)


class FixedTarget(DiffusersTarget):
    """The stock target; while its parallel state is up (forward and backward of a case) the direction is fixed."""

    name = "diffusers_ring_grad_fixed"

    def init_parallel(self, ulysses_degree: int, ring_degree: int) -> None:
        funcol.permute_tensor = _inverse_permute
        super().init_parallel(ulysses_degree, ring_degree)

    def destroy_parallel(self) -> None:
        funcol.permute_tensor = _permute
        super().destroy_parallel()

    def make_attention(self, spec: AttentionSpec) -> DiffusersAttention:
        attn = super().make_attention(spec)
        attn.kernel += " [test-only: ring backward accumulators sent to rank - 1]"
        return attn


def factory() -> FixedTarget:
    return FixedTarget()
