"""TEST-ONLY: the reference target with one bug planted in its sequence-parallel backward, its forward unchanged.

Each bug is one a ring or Ulysses implementation can plausibly ship, and each leaves every
forward contract passing (bitwise where it was):

- ``ring_detached``: the K/V a rank receives from its ring neighbour is detached, so the remote
  blocks' contributions to dk and dv never travel back (a ring written for inference, then trained);
- ``ring_same_direction``: the backward of a ring shift sends the gradient on to the *next* rank
  instead of back to the previous one; with two ranks next and previous coincide, so only W >= 3
  can see it;
- ``ulysses_averaged``: the backward of the Ulysses output all-to-all divides the gradient by the
  Ulysses degree, as if the exchange were a data-parallel average.

The bug is planted by patching ``reference_impl.parallel.comm`` for the duration of each call
(the forward builds the autograd graph, so the backward keeps the planted Function).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from reference_impl.parallel import comm
from tests.targets.planting import PlantedTarget, ScaleGrad, planted_target

Tensor = torch.Tensor
_ring_shift, _head_to_seq = comm.ring_shift, comm.head_to_seq_all_to_all


def _detached_shift(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    return _ring_shift([t.detach() for t in tensors], group)


class _ShiftOnwards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):  # type: ignore[override]
        ctx.group = group
        return tuple(comm._shift(tensors, group, +1))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, *comm._shift(grads, ctx.group, +1))  # the bug: +1, where the adjoint is -1


def _same_direction_shift(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    return list(_ShiftOnwards.apply(group, *tensors))


def _averaged_head_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return ScaleGrad.apply(_head_to_seq(x, group), 1.0 / dist.get_world_size(group))


BUGS: dict[str, tuple[str, Callable[..., Any]]] = {
    "ring_detached": ("ring_shift", _detached_shift),
    "ring_same_direction": ("ring_shift", _same_direction_shift),
    "ulysses_averaged": ("head_to_seq_all_to_all", _averaged_head_to_seq),
}


@contextmanager
def planted(bug: str) -> Iterator[None]:
    name, replacement = BUGS[bug]
    with mock.patch.object(comm, name, replacement):
        yield


def factory(bug: str) -> PlantedTarget:
    return planted_target(bug, BUGS, planted, "backward")
