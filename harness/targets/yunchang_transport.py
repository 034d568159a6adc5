"""A transport shim for yunchang's ring on gloo: its point-to-point transfers staged through host memory.

Ranks that share one GPU talk over gloo. gloo runs yunchang's all-to-alls on CUDA tensors, but its
``batch_isend_irecv`` of CUDA tensors fails ("writev ... Bad address", measured on an H200), and NCCL refuses
two ranks on one device. yunchang's ring moves K/V (and in backward dK/dV) with ``RingComm``:
``send_recv`` queues a send to the next rank and a receive from the previous one, ``commit`` starts them,
``wait`` completes them. :func:`staged_commit` replaces ``commit`` only: each tensor is copied to the host
and sent from there, each receive lands in a host buffer copied into yunchang's tensor when ``wait`` returns.
The bytes, peers and order are yunchang's; its arithmetic is untouched (tests/targets/test_yunchang_transport.py
checks that staged and direct transfers give byte-identical results on gloo).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class StagedRequest:
    """The requests of one staged batch: ``wait`` waits for all, then copies each host buffer into its tensor."""

    def __init__(self, requests: list[Any], landing: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._requests, self._landing = requests, landing

    def wait(self) -> bool:
        for request in self._requests:
            request.wait()
        for tensor, host in self._landing:
            tensor.copy_(host)
        self._landing = []
        return True


def staged_batch_isend_irecv(ops: list[dist.P2POp]) -> list[StagedRequest]:
    """``dist.batch_isend_irecv`` with every tensor passed through a host copy (peers and order unchanged)."""
    staged, landing = [], []
    for op in ops:
        if op.op in (dist.isend, dist.send):
            host = op.tensor.detach().to("cpu", copy=True)
        else:
            host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype, device="cpu")
            landing.append((op.tensor, host))
        staged.append(dist.P2POp(op.op, host, op.peer, group=op.group, tag=op.tag))
    return [StagedRequest(dist.batch_isend_irecv(staged), landing)]


def staged_commit(comm: Any) -> None:
    """``RingComm.commit`` through host memory: what yunchang queued, in its order, to its peers."""
    if comm._reqs is not None:
        raise RuntimeError("commit called twice")
    comm._reqs = staged_batch_isend_irecv(comm._ops)


_DIRECT: dict[str, Any] = {}


def stage_ring_transfers(commit: Any = staged_commit) -> None:
    """Route every ``yunchang.ring.utils.RingComm`` of this process through ``commit`` until
    :func:`direct_ring_transfers`."""
    from yunchang.ring.utils import RingComm

    _DIRECT.setdefault("commit", RingComm.commit)
    RingComm.commit = commit  # type: ignore[method-assign]


def direct_ring_transfers() -> None:
    """yunchang's own ``commit`` again."""
    if "commit" in _DIRECT:
        from yunchang.ring.utils import RingComm

        RingComm.commit = _DIRECT.pop("commit")  # type: ignore[method-assign]
