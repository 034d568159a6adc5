"""The reference target with a sequence-parallel defect planted inside the reference models' attention: every
SP call of ``USPAttention`` on rank 1 returns its output scaled by 1 + 2^-4 (a wrong rank, as
tests/targets/planted_sp.py's ``scaled_rank`` plants for the attention contracts). Single-rank calls, the model
checks' references, are untouched, so ``model.*_sp_parity`` must fail and say the difference is on rank 1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from harness.targets.reference import ReferenceTarget
from reference_impl.attention.layer import USPAttention
from reference_impl.parallel.state import get_sp_world_size, sequence_parallel_initialized


@contextmanager
def _rank_one_scaled() -> Iterator[None]:
    original = USPAttention.forward

    def forward(self: USPAttention, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        sharded = sequence_parallel_initialized() and get_sp_world_size() > 1
        return out * (1 + 2.0**-4) if sharded and dist.get_rank() == 1 else out

    USPAttention.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        USPAttention.forward = original  # type: ignore[method-assign]


class PlantedModelTarget(ReferenceTarget):
    name = "planted_model"

    def model_check(self, name: str) -> Callable[..., Any]:
        check = super().model_check(name)

        def planted(**kwargs: Any) -> Any:
            with _rank_one_scaled():
                return check(**kwargs)

        return planted


def factory(**_: str) -> PlantedModelTarget:
    return PlantedModelTarget()
