"""What a contract measures in each rank: the :class:`Stats` of a comparison, and tensor digests.

Ranks return small sums and maxima, never tensors: they are cheap to send back through the
launcher's pipe and merge exactly (a max of maxima, a sum of sums), so the figures of an
N-rank case are the same as if one process had compared the whole output.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Stats:
    """Comparison of an output with its expected value, mergeable across ranks.

    ``max_abs`` etc. are against the single-rank reference; ``err_ref64`` (|out − ref64|) and
    ``naive_err_ref64`` (|naive_lowprec − ref64|) are filled only for the FlashAttention rule.
    """

    count: int = 0
    mismatched: int | None = 0  # None: not counted (a figure taken from elsewhere said "not bitwise")
    nonfinite: int = 0
    ref_nonfinite: int = 0
    max_abs: float = 0.0
    sum_abs: float = 0.0
    sum_sq_err: float = 0.0
    sum_sq_ref: float = 0.0
    err_ref64: float | None = None
    naive_err_ref64: float | None = None

    def merge(self, other: Stats) -> Stats:
        def opt_max(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else max(a, b)

        return Stats(
            self.count + other.count,
            None if self.mismatched is None or other.mismatched is None else self.mismatched + other.mismatched,
            self.nonfinite + other.nonfinite,
            self.ref_nonfinite + other.ref_nonfinite,
            max(self.max_abs, other.max_abs),
            self.sum_abs + other.sum_abs,
            self.sum_sq_err + other.sum_sq_err,
            self.sum_sq_ref + other.sum_sq_ref,
            opt_max(self.err_ref64, other.err_ref64),
            opt_max(self.naive_err_ref64, other.naive_err_ref64),
        )

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
        if self.nonfinite or self.ref_nonfinite:
            figures["nonfinite"] = self.nonfinite
            figures["ref_nonfinite"] = self.ref_nonfinite
        if self.err_ref64 is not None:
            figures["err_ref64"] = self.err_ref64
            figures["naive_err_ref64"] = self.naive_err_ref64
        return figures


def compare(
    out: torch.Tensor,
    expected: torch.Tensor,
    ref64: torch.Tensor | None = None,
    naive: torch.Tensor | None = None,
) -> Stats:
    """Stats of ``out`` against ``expected`` (same shape); with ``ref64`` and ``naive`` also the FA-rule errors.

    Bitwise means the same dtype and value equality as ``torch.equal`` defines it (NaN never
    equals anything).
    """
    if out.shape != expected.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != expected shape {tuple(expected.shape)}")
    o, e = out.detach().double().cpu(), expected.detach().double().cpu()
    out_finite, ref_finite = torch.isfinite(o), torch.isfinite(e)
    finite = out_finite & ref_finite
    # Non-finite values are counted (and always fail), never summed into the figures.
    diff = torch.where(finite, (o - e).abs(), torch.zeros_like(o))
    # Different dtypes are never bitwise equal, even where the values compare equal once promoted.
    mismatched = o.numel() if out.dtype != expected.dtype else int((out != expected).sum().item())
    stats = Stats(
        count=o.numel(),
        mismatched=mismatched,
        nonfinite=int((~out_finite).sum().item()),
        ref_nonfinite=int((~ref_finite).sum().item()),
        max_abs=float(diff.max().item()) if diff.numel() else 0.0,
        sum_abs=float(diff.sum().item()),
        sum_sq_err=float((diff * diff).sum().item()),
        sum_sq_ref=float(torch.where(ref_finite, e * e, torch.zeros_like(e)).sum().item()),
    )
    if ref64 is not None and naive is not None:
        r = ref64.detach().double().cpu()
        err = torch.where(finite, (o - r).abs(), torch.zeros_like(o))
        stats.err_ref64 = float(err.max().item()) if err.numel() else 0.0
        stats.naive_err_ref64 = float((naive.detach().double().cpu() - r).abs().max().item()) if r.numel() else 0.0
    return stats


def digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes: equal digests on two ranks mean the same tensor, bit for bit."""
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
