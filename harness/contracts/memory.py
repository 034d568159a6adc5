"""What an attention case will hold in memory, estimated from its parameters before any rank starts.

A case the device cannot hold is skipped with the estimate and the device's size as the reason (a
property of the machine, like a job with too few ranks: not a claim about the target), never ended
by an out-of-memory traceback. The estimate adds up the tensors a rank holds at its peak: the
whole-sequence inputs and single-rank outputs (three, with the determinism runs), its shard and the
sequence-parallel exchange, the oracle's float64 keys and values and its rows (whole gradients for a
gradient contract), and the oracle's block temporaries (:data:`~harness.contracts.oracles.BLOCK_ELEMENTS`).
Ranks sharing one GPU (more ranks than GPUs) or one host share its memory.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.contracts.oracles import BLOCK_ELEMENTS
from harness.contracts.params import Params
from harness.ranks import choose_backend
from harness.ranks.session import active_session

GIB = 1 << 30
#: What a rank process holds besides the case: the interpreter, torch, and on a GPU its CUDA context.
PROCESS_BYTES = {"cuda": GIB, "cpu": GIB // 2}
SAFETY = 1.25  # the allocator's rounding and fragmentation, the target's own workspace


@dataclass(frozen=True)
class Footprint:
    """A case's estimated bytes per rank and how many ranks share one device's ``capacity``."""

    per_rank: int
    ranks_sharing: int
    capacity: int
    device: str

    @property
    def needed(self) -> int:
        return self.per_rank * self.ranks_sharing

    def reason(self) -> str | None:
        """Why the case cannot run here, or None when it fits."""
        if self.needed <= self.capacity:
            return None
        shared = f" ({self.ranks_sharing} ranks × {self.per_rank / GIB:.1f} GiB)" if self.ranks_sharing > 1 else ""
        return (
            f"needs about {self.needed / GIB:.1f} GiB of {self.device} memory{shared}; this {self.device} has "
            f"{self.capacity / GIB:.1f} GiB (parity's estimate before starting the case)"
        )


def attention_bytes(p: Params, device: str, *, gradient: bool) -> int:
    """Bytes one rank holds at its peak in a ``usp.*`` case (see the module docstring for the terms)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    size = torch.empty((), dtype=p.torch_dtype).element_size()
    tokens = p.batch * (p.tokens + (p.get("replicated", 0) or 0))  # the whole sequence, replicated tokens included
    queries, kv = tokens * p.heads * p.head_dim, tokens * p.kv_heads * p.head_dim  # elements of q and of k or v
    mine = p.batch * (p.tokens_per_rank + (p.get("replicated", 0) or 0)) * p.heads * p.head_dim  # this rank's rows
    inputs = (queries + 2 * kv) * size
    # the whole inputs, their shard and its exchange; the single-rank output, its repeat and its head-group run
    held = inputs * (1 + 4 / p.world_size) + 3 * queries * size
    # float64 K and V with every query head (GQA expanded) and the same in the dtype; the oracle's rows
    oracle = 2 * queries * (8 + size) + mine * (8 + size)
    temporaries = BLOCK_ELEMENTS[kind] * 8 * 5
    if gradient:
        held += 4 * inputs  # the leaves, and dq, dk, dv of the three single-rank backward runs
        # the whole float64 dq (its dk, dv accumulators: float64), the naive ones (float32 accumulators), and both
        # cast back to the input's shapes
        oracle += queries * (8 + size) + 2 * queries * (8 + 4) + 2 * kv * (8 + size)
        temporaries = BLOCK_ELEMENTS[kind] * 8 * 7
    return int(SAFETY * (held + oracle + temporaries)) + PROCESS_BYTES[kind]


def footprint(p: Params, device: str, *, gradient: bool) -> Footprint | None:
    """The case's :class:`Footprint` on ``device`` ("cpu" or "cuda[:i]") of this machine (None: no such GPU here,
    which the run reports on its own)."""
    per_rank = attention_bytes(p, device, gradient=gradient)
    if not device.startswith("cuda"):
        return Footprint(per_rank, p.world_size, _host_bytes(), "host")
    if not torch.cuda.is_available():
        return None
    index = torch.device(device).index or 0
    sharing = 1 if active_session() or choose_backend(device, p.world_size)[0] == "nccl" else p.world_size
    return Footprint(per_rank, sharing, torch.cuda.get_device_properties(index).total_memory, "GPU")


def _host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def reset_peaks(device: torch.device) -> None:
    """Start measuring this rank's peak memory afresh (Linux resets the resident peak through clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peaks(device: torch.device) -> dict[str, float]:
    """This rank's peak memory since :func:`reset_peaks`, in GiB: ``device`` (what torch allocated on the GPU)
    and ``host`` (resident set), where this platform tells."""
    measured: dict[str, float] = {}
    if device.type == "cuda":
        measured["device"] = torch.cuda.max_memory_allocated(device) / GIB
    with contextlib.suppress(OSError, ValueError):
        status = Path("/proc/self/status").read_text()
        kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))
        measured["host"] = int(kib) / (1 << 20)
    return measured
