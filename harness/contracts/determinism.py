"""Whether a bitwise claim can hold: the single-rank computation run twice, and run in the head groups a Ulysses
rank computes.

Bitwise parity with one rank needs a kernel that gives the same bits twice at the shape (torch SDPA's flash and
cuDNN backward do not, on an H200, from a few thousand tokens) and gives a head group's rows the same bits as
the whole (a Ulysses rank calls the kernel with H/U heads; SDPA's deterministic flash backward does not, at
Z-Image 1024² on an H200). Each is measured under a bitwise bound; where one differs, the judging falls back on
that spread (:class:`harness.contracts.bounds.JitterBound`) and says which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.contracts.bounds import Bitwise
from harness.contracts.params import Params
from harness.contracts.registry import RankContext
from harness.contracts.stats import Stats, compare, magnitude_floor
from harness.targets.base import Unsupported

Tensor = torch.Tensor
Computation = Callable[[Callable[..., Tensor]], Sequence[Tensor]]  # attention -> what is compared (out, or grads)


@dataclass(frozen=True)
class Spreads:
    """Per comparison name: the second run against the first, and the head-group run against the first."""

    again: dict[str, Stats]
    head_groups: dict[str, Stats]


def measured(
    ctx: RankContext, p: Params, names: Sequence[str], compute: Computation, first: Sequence[Tensor], groups: int
) -> Spreads:
    """Under a bitwise bound: ``compute`` once more with the single-rank attention, and (``groups`` > 1, a Ulysses
    degree) once with it called per head group; each against ``first``. Empty under any other bound."""
    if not isinstance(ctx.bound, Bitwise):
        return Spreads({}, {})
    again = _against(names, compute(ctx.attention(p, skip_sequence_parallel=True)), first)
    if groups == 1:
        return Spreads(again, {})
    try:
        split = compute(HeadGroups(ctx.attention(p, **_group_heads(p, groups)), groups))
    except Unsupported:  # a target that cannot build a head group's layer: not measured, the case still runs
        return Spreads(again, {})
    return Spreads(again, _against(names, split, first))


def _against(names: Sequence[str], results: Sequence[Tensor], first: Sequence[Tensor]) -> dict[str, Stats]:
    return {n: compare(r, f, ulps_above=magnitude_floor(f)) for n, r, f in zip(names, results, first)}


def _group_heads(p: Params, groups: int) -> dict[str, Any]:
    return {"skip_sequence_parallel": True, "num_heads": p.heads // groups, "num_kv_heads": p.kv_heads // groups}


class HeadGroups:
    """A rank-local attention called once per contiguous head group (a Ulysses rank's share of the heads), the
    group outputs concatenated: what the sharded path computes, without its exchanges."""

    def __init__(self, attention: Callable[..., Tensor], groups: int) -> None:
        self.attention, self.groups = attention, groups

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
        outs = []
        for g in range(self.groups):
            part = {name: _heads(value, g, self.groups, 1) for name, value in kwargs.items()}
            outs.append(self.attention(*(_heads(t, g, self.groups, 2) for t in (q, k, v)), **part))
        return torch.cat(outs, dim=2)


def _heads(value: Any, group: int, groups: int, dim: int) -> Any:
    """Head group ``group`` of a ``[B, S, H, D]`` tensor (dim 2), or of a dense ``[B, H, Sq, Sk]`` mask (dim 1);
    anything else (a key mask, a count) as it is."""
    if not isinstance(value, Tensor) or value.dim() != 4 or value.shape[dim] % groups or value.shape[dim] == 1:
        return value
    size = value.shape[dim] // groups
    return value.narrow(dim, group * size, size)
