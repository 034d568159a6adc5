"""What a contract measures in each rank: the :class:`Stats` of a comparison, and tensor digests.

Ranks return small sums and maxima, never tensors: they are cheap to send back through the
launcher's pipe and merge exactly (a max of maxima, a sum of sums), so the figures of an
N-rank case are the same as if one process had compared the whole output. A comparison runs on
the tensors' own device in chunks of :data:`CHUNK` elements, so a 119k-token output costs a few
chunk-sized float64 temporaries, not float64 copies of whole tensors on the host.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor
CHUNK = 1 << 22  # elements per chunk of a comparison: 32 MiB of float64 per temporary
#: Below this fraction of a tensor's largest magnitude an element's ulp is taken at that fraction: a sum that
#: cancels to almost nothing carries the rounding of its terms, not of its result (see :func:`ulps`).
ULP_FLOOR_FRACTION = 2.0**-8
_MAXIMA = ("max_abs", "max_ulps", "err_ref64", "naive_err_ref64", "ref64_max")
_SUMS = ("count", "nonfinite", "ref_nonfinite", "sum_abs", "sum_sq_err", "sum_sq_ref")


@dataclass
class Where:
    """Where a ``[B, S, H, D]`` comparison's largest difference is, and how its large ones spread: the worst
    element's rank, batch, token (the rank's own row) and head, each head's largest difference, and per rank its
    largest and how many of its tokens hold a difference above half of that (a head-order bug shows in one head
    on every rank, a wrong rank on one rank's every token)."""

    worst: tuple[int, int, int, int]  # rank, batch, token, head
    value: float
    head_max: list[float]
    ranks: dict[int, tuple[float, int, int]]  # rank -> (its largest difference, tokens above half of it, tokens)

    def merge(self, other: Where) -> Where:
        first, second = (self, other) if self.value >= other.value else (other, self)
        heads = first.head_max
        if len(first.head_max) == len(second.head_max):
            heads = [max(a, b) for a, b in zip(first.head_max, second.head_max)]
        return Where(first.worst, first.value, heads, {**second.ranks, **first.ranks})

    def describe(self) -> str:
        rank, batch, token, head = self.worst
        half = self.value / 2
        heads = [str(h) for h, m in enumerate(self.head_max) if m >= half]
        ranks = [f"{r} ({hit} of {n} tokens)" for r, (m, hit, n) in sorted(self.ranks.items()) if m >= half]
        return (
            f"worst at rank {rank}, batch {batch}, its token {token}, head {head}; above half the worst: "
            f"head{'s' if len(heads) > 1 else ''} {', '.join(heads)} of {len(self.head_max)}, "
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"
        )

    def figures(self) -> dict[str, Any]:
        rank, batch, token, head = self.worst
        return {
            "worst": {"rank": rank, "batch": batch, "token": token, "head": head, "abs": self.value},
            "head_max": self.head_max,
            "ranks": {
                str(r): {"max_abs": m, "tokens_above_half": hit, "tokens": n} for r, (m, hit, n) in self.ranks.items()
            },
        }


@dataclass
class Stats:
    """Comparison of an output with its expected value, mergeable across ranks.

    ``max_abs`` etc. are against the single-rank reference; ``max_ulps`` is the same distance in units
    in the last place of the expected value's dtype (:func:`ulps`; measured where a bitwise claim may
    have to fall back on a kernel's run-to-run spread). ``err_ref64`` (|out − ref64|),
    ``naive_err_ref64`` (|naive_lowprec − ref64|) and ``ref64_max`` (max|ref64|, what the rule's floor
    scales with) are filled only for the FlashAttention rule.
    """

    count: int = 0
    mismatched: int | None = 0  # None: not counted (a figure taken from elsewhere said "not bitwise")
    nonfinite: int = 0
    ref_nonfinite: int = 0
    max_abs: float = 0.0
    sum_abs: float = 0.0
    sum_sq_err: float = 0.0
    sum_sq_ref: float = 0.0
    max_ulps: float | None = None
    err_ref64: float | None = None
    naive_err_ref64: float | None = None
    ref64_max: float | None = None
    where: Where | None = None  # where the differences are (4-D tensors with one)

    def merge(self, other: Stats) -> Stats:
        def opt_max(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else max(a, b)

        maxima = {n: opt_max(getattr(self, n), getattr(other, n)) for n in _MAXIMA}
        sums = {n: getattr(self, n) + getattr(other, n) for n in _SUMS}
        mismatched = None if self.mismatched is None or other.mismatched is None else self.mismatched + other.mismatched
        where = self.where.merge(other.where) if self.where and other.where else self.where or other.where
        return Stats(mismatched=mismatched, **sums, **maxima, where=where)

    @property
    def bitwise(self) -> bool:
        return self.count > 0 and self.mismatched == 0

    def figures(self) -> dict[str, Any]:
        figures: dict[str, Any] = {
            "bitwise": self.bitwise,
            "max_abs": self.max_abs,
            "mean_abs": self.sum_abs / self.count if self.count else 0.0,
            "rel_err": math.sqrt(self.sum_sq_err / self.sum_sq_ref) if self.sum_sq_ref else 0.0,
            "elements": self.count,
        }
        if self.mismatched is not None:
            figures["mismatched"] = self.mismatched
        if self.max_ulps is not None:
            figures["max_ulps"] = self.max_ulps
        if self.nonfinite or self.ref_nonfinite:
            figures["nonfinite"] = self.nonfinite
            figures["ref_nonfinite"] = self.ref_nonfinite
        if self.err_ref64 is not None:
            figures["err_ref64"] = self.err_ref64
            figures["naive_err_ref64"] = self.naive_err_ref64
            figures["ref64_max"] = self.ref64_max
        if self.where is not None:
            figures["where"] = self.where.figures()
        return figures


def chunks(*tensors: Tensor | None) -> Iterator[tuple[Tensor | None, ...]]:
    """Aligned flat chunks of same-sized tensors, each as float64 on the first tensor's device (None stays None)."""
    first = tensors[0]
    assert first is not None
    flat = [None if t is None else t.detach().reshape(-1) for t in tensors]
    for start in range(0, first.numel(), CHUNK):
        yield tuple(
            None if t is None else t[start : start + CHUNK].to(device=first.device, dtype=torch.float64) for t in flat
        )


def ulps(diff: Tensor, expected: Tensor, dtype: torch.dtype, magnitude_floor: float) -> Tensor:
    """``diff`` in units in the last place of ``dtype`` at ``max(|expected|, magnitude_floor)`` (float64 inputs)."""
    info = torch.finfo(dtype)
    scale = expected.abs().clamp(min=max(magnitude_floor, info.tiny))
    _, exponent = torch.frexp(scale)  # scale = m·2^e with m in [0.5, 1): its binade starts at 2^(e-1)
    return diff / torch.ldexp(torch.full_like(scale, info.eps), exponent - 1)  # eps·2^(e-1): the binade's spacing


def magnitude_floor(tensor: Tensor) -> float:
    """:data:`ULP_FLOOR_FRACTION` of ``tensor``'s largest finite magnitude (0 for an empty or all non-finite one)."""
    largest = 0.0
    for (chunk,) in chunks(tensor):
        assert chunk is not None
        if chunk.numel():
            largest = max(largest, float(torch.where(torch.isfinite(chunk), chunk.abs(), 0.0).max().item()))
    return largest * ULP_FLOOR_FRACTION


def compare(
    out: Tensor,
    expected: Tensor,
    ref64: Tensor | None = None,
    naive: Tensor | None = None,
    *,
    ulps_above: float | None = None,
) -> Stats:
    """Stats of ``out`` against ``expected`` (same shape); with ``ref64`` and ``naive`` also the FA-rule errors;
    with ``ulps_above`` (a :func:`magnitude_floor`) also ``max_ulps`` in ``expected``'s dtype.

    Bitwise means the same dtype and value equality as ``torch.equal`` defines it (NaN never
    equals anything).
    """
    if out.shape != expected.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != expected shape {tuple(expected.shape)}")
    stats = Stats(count=out.numel(), mismatched=0 if out.dtype == expected.dtype else out.numel())
    oracle = ref64 is not None and naive is not None
    if oracle:
        stats.err_ref64 = stats.naive_err_ref64 = stats.ref64_max = 0.0
    if ulps_above is not None:
        stats.max_ulps = 0.0
    located = _Locator(out) if out.dim() == 4 and out.numel() else None
    for o, e, r, n in chunks(out, expected, ref64 if oracle else None, naive if oracle else None):
        diff = _add_chunk(stats, o, e, r, n, expected.dtype, ulps_above, bitwise=out.dtype == expected.dtype)
        if located is not None:
            located.add(diff)
    stats.where = located.where() if located is not None and stats.max_abs > 0 else None
    return stats


class _Locator:
    """Per head and per token, the largest difference of a ``[B, S, H, D]`` comparison, chunk by chunk."""

    def __init__(self, t: Tensor) -> None:
        self.batch, self.tokens, self.heads, self.dim = t.shape
        self.head_max = torch.zeros(self.heads, dtype=torch.float64, device=t.device)
        self.token_max = torch.zeros(self.batch * self.tokens, dtype=torch.float64, device=t.device)
        self.start = 0

    def add(self, diff: Tensor) -> None:
        index = torch.arange(self.start, self.start + diff.numel(), device=diff.device)
        self.head_max.scatter_reduce_(0, (index // self.dim) % self.heads, diff, "amax")
        self.token_max.scatter_reduce_(0, index // (self.dim * self.heads), diff, "amax")
        self.start += diff.numel()

    def where(self) -> Where:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        row, head = int(self.token_max.argmax().item()), int(self.head_max.argmax().item())
        value = float(self.token_max.max().item())
        above = int((self.token_max >= value / 2).sum().item())
        worst = (rank, row // self.tokens, row % self.tokens, head)
        return Where(worst, value, self.head_max.tolist(), {rank: (value, above, self.token_max.numel())})


def _add_chunk(
    stats: Stats,
    o: Tensor | None,
    e: Tensor | None,
    r: Tensor | None,
    n: Tensor | None,
    dtype: torch.dtype,
    ulps_above: float | None,
    bitwise: bool,
) -> Tensor:
    """One chunk's sums and maxima into ``stats``; its differences. Non-finite values are counted (and always
    fail), never summed."""
    assert o is not None and e is not None
    out_finite, ref_finite = torch.isfinite(o), torch.isfinite(e)
    finite = out_finite & ref_finite
    diff = torch.where(finite, (o - e).abs(), 0.0)
    if bitwise:  # float64 holds every narrower value exactly: equal here is equal in the dtype
        assert stats.mismatched is not None
        stats.mismatched += int((o != e).sum().item())
    stats.nonfinite += int((~out_finite).sum().item())
    stats.ref_nonfinite += int((~ref_finite).sum().item())
    stats.max_abs = max(stats.max_abs, float(diff.max().item()) if diff.numel() else 0.0)
    stats.sum_abs += float(diff.sum().item())
    stats.sum_sq_err += float((diff * diff).sum().item())
    stats.sum_sq_ref += float(torch.where(ref_finite, e * e, 0.0).sum().item())
    if ulps_above is not None and diff.numel():
        stats.max_ulps = max(stats.max_ulps or 0.0, float(ulps(diff, e, dtype, ulps_above).max().item()))
    if r is not None and n is not None and r.numel():
        stats.err_ref64 = max(stats.err_ref64 or 0.0, float(torch.where(finite, (o - r).abs(), 0.0).max().item()))
        stats.naive_err_ref64 = max(stats.naive_err_ref64 or 0.0, float((n - r).abs().max().item()))
        finite_ref = torch.where(torch.isfinite(r), r.abs(), 0.0)
        stats.ref64_max = max(stats.ref64_max or 0.0, float(finite_ref.max().item()))
    return diff


def digest(tensor: Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes: equal digests on two ranks mean the same tensor, bit for bit."""
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
