"""Rank functions for tests/targets/test_yunchang_transport.py, and the planted defect: a staged transfer with
the ring's direction reversed (each rank receives from its next rank, a rank-order swap)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.targets import yunchang_transport

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reversed_commit(comm: Any) -> None:
    """The planted defect: yunchang's queued ops with the ring reversed (send to the previous rank, receive from
    the next): at ring degree 2 both are one rank, from 3 on every block lands on the wrong rank."""
    comm._ops = [
        dist.P2POp(op.op, op.tensor, comm.recv_rank if op.op is dist.isend else comm.send_rank, group=op.group)
        for op in comm._ops
    ]
    yunchang_transport.staged_commit(comm)


def start(rank: int) -> list[torch.Tensor]:
    """What ``rank`` starts the hops with: one tensor of every dtype, drawn from a generator seeded by the rank."""
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(3, 5, 7, generator=gen).to(dtype) for dtype in DTYPES]


def ring_hops(transport: str) -> list[list[bytes]]:
    """Three hops of yunchang's RingComm over the world group, each passing what the rank holds on: after each
    hop, what the rank holds, as bytes."""
    from yunchang.ring.utils import RingComm

    commits = {"direct": None, "staged": yunchang_transport.staged_commit, "reversed": reversed_commit}
    if commits[transport] is not None:
        yunchang_transport.stage_ring_transfers(commits[transport])
    try:
        held, seen = start(dist.get_rank()), []
        for _ in range(3):
            comm = RingComm(None)
            held = [comm.send_recv(t) for t in held]
            comm.commit()
            comm.wait()
            seen.append([t.view(torch.uint8).numpy().tobytes() for t in held])
        return seen
    finally:
        yunchang_transport.direct_ring_transfers()
