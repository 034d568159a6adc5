"""Whether a bitwise claim can hold: the single-rank computation run again, and run in the head groups a Ulysses
rank computes.

Bitwise parity with one rank needs a kernel that gives the same bits twice at the shape (torch SDPA's flash and
cuDNN backward do not, on an H200, from a few thousand tokens) and gives a head group's rows the same bits as
the whole (a Ulysses rank calls the kernel with H/U heads; SDPA's deterministic flash backward does not, at
Z-Image 1024² on an H200). Under a bitwise bound both runs are made here; the judges
(:func:`harness.contracts.outputs.judge_runs`) hold each against the first run, whose spread may become the
bound (:class:`harness.contracts.bounds.JitterBound`), and against float64 attention, so a run that is wrong
rather than reordered fails instead of widening the bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.contracts.bounds import Bitwise
from harness.contracts.judging import Role
from harness.contracts.params import Params
from harness.contracts.registry import RankContext
from harness.targets.base import Unsupported

Tensor = torch.Tensor
Computation = Callable[[Callable[..., Tensor]], Sequence[Tensor]]  # attention -> what is compared (out, or grads)


@dataclass(frozen=True)
class Runs:
    """The extra single-rank runs of a bitwise case (:data:`Role.REPEAT`, :data:`Role.HEAD_GROUPS`), each the
    computation's results; ``unmeasured``: why a run was not made (the target refused a head group's layer)."""

    results: dict[Role, Sequence[Tensor]] = field(default_factory=dict)
    unmeasured: str | None = None


def extra_runs(ctx: RankContext, p: Params, compute: Computation, groups: int, replicated: bool = False) -> Runs:
    """Under a bitwise bound: ``compute`` once more with the single-rank attention and (``groups`` > 1, a Ulysses
    degree) once with it called per head group. Under any other bound only the repeat, and only for a case with
    ``replicated`` tokens: every rank holding the same copy is a bitwise claim (ranks of a hybrid's ring
    positions compute their own), which a kernel that differs from itself cannot keep."""
    bitwise = isinstance(ctx.bound, Bitwise)
    if not bitwise and not replicated:
        return Runs()
    results: dict[Role, Sequence[Tensor]] = {Role.REPEAT: compute(ctx.attention(p, skip_sequence_parallel=True))}
    if groups == 1 or not bitwise:
        return Runs(results)
    try:
        results[Role.HEAD_GROUPS] = compute(HeadGroups(ctx.attention(p, **_group_heads(p, groups)), groups))
    except Unsupported as exc:  # a measurement, not a requirement: the case still runs, saying so
        return Runs(
            results, f"head groups not measured: the target refused a {p.heads // groups}-head layer ({exc.reason})"
        )
    return Runs(results)


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
