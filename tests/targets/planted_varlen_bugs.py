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
from contextlib import AbstractContextManager
from typing import Any
from unittest import mock

import torch

from reference_impl.attention.layer import USPAttention
from tests.targets.planting import PlantedTarget, planted_target

Tensor = torch.Tensor
_check_ring = USPAttention._check_ring


def _attends_padding(self: USPAttention, q: Tensor, k: Tensor, v: Tensor, attn_mask: Any, seq_lens: Any) -> Tensor:
    return self._local(q, k, v, attn_mask)


def _no_varlen_refusal(self: USPAttention, q: Tensor, k: Tensor, v: Tensor, attn_mask: Any,
                       seq_lens: Sequence[int] | None, kv_prefix: int) -> None:  # fmt: skip
    _check_ring(self, q, k, v, attn_mask, None, kv_prefix)


BUGS = {"single_rank_attends_padding": ("_forward_single_rank", _attends_padding),
        "ring_varlen_unrefused": ("_check_ring", _no_varlen_refusal)}  # fmt: skip


def planted(bug: str) -> AbstractContextManager[Any]:
    name, replacement = BUGS[bug]
    return mock.patch.object(USPAttention, name, replacement)


def factory(bug: str) -> PlantedTarget:
    return planted_target(bug, BUGS, planted, "varlen")
