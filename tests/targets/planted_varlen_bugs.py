"""TEST-ONLY: the reference target with one varlen bug planted, each one only the one-rank-padding and ring
varlen cases see (every other varlen case passes with it):

- ``single_rank_attends_padding``: on one rank, the layer attends to every row, padding included (as if
  ``seq_lens`` were not passed), and returns the padding rows as computed;
- ``ring_varlen_unrefused``: the layer's refusal of ``seq_lens`` under ring is gone, so its varlen all-to-all (the
  Ulysses group only, not ring-aware) runs and each ring rank attends to its own keys alone.

Each is planted by patching ``reference_impl``'s USPAttention for the duration of each call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from unittest import mock

import torch

from harness.targets.base import AttentionSpec
from harness.targets.reference.attention import ReferenceAttention, ReferenceTarget
from reference_impl.attention.layer import USPAttention

Tensor = torch.Tensor
_check_ring = USPAttention._check_ring


def _attends_padding(self: USPAttention, q: Tensor, k: Tensor, v: Tensor, attn_mask: Any, seq_lens: Any) -> Tensor:
    return self._local(q, k, v, attn_mask)


def _no_varlen_refusal(self: USPAttention, q: Tensor, k: Tensor, v: Tensor, attn_mask: Any,
                       seq_lens: Sequence[int] | None, kv_prefix: int) -> None:  # fmt: skip
    _check_ring(self, q, k, v, attn_mask, None, kv_prefix)


BUGS = {"single_rank_attends_padding": ("_forward_single_rank", _attends_padding),
        "ring_varlen_unrefused": ("_check_ring", _no_varlen_refusal)}  # fmt: skip


class PlantedAttention:
    """The reference attention, each call made with the bug in place."""

    def __init__(self, inner: ReferenceAttention, bug: str) -> None:
        self.inner, self.bug = inner, bug
        self.backend = inner.backend
        self.kernel = f"{inner.kernel} [planted varlen bug: {bug}]"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
        name, replacement = BUGS[self.bug]
        with mock.patch.object(USPAttention, name, replacement):
            return self.inner(q, k, v, **kwargs)


class PlantedTarget(ReferenceTarget):
    def __init__(self, bug: str) -> None:
        self.bug = bug
        self.name = f"planted_{bug}"

    def make_attention(self, spec: AttentionSpec) -> PlantedAttention:  # type: ignore[override]
        return PlantedAttention(super().make_attention(spec), self.bug)


def factory(bug: str) -> PlantedTarget:
    if bug not in BUGS:
        raise ValueError(f"unknown planted bug {bug!r}; valid: {', '.join(BUGS)}")
    return PlantedTarget(bug)
