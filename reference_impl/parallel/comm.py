"""Collectives for sequence parallelism, on NCCL or gloo.

gloo has ``all_to_all_single`` but no list ``all_to_all``, and it cannot move CUDA tensors
for every op; when the group is gloo and a tensor lives on a GPU (several ranks sharing one
GPU), the tensor is staged through host memory. That is pure data movement, so it is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def _needs_staging(tensor: Tensor, group: dist.ProcessGroup) -> bool:
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


def _all_to_all_flat(
    send: Tensor, group: dist.ProcessGroup, out_numel: int, in_splits: list[int] | None, out_splits: list[int] | None
) -> Tensor:
    """all_to_all_single on a 1-D contiguous buffer, staged through the host when needed."""
    device = send.device
    if _needs_staging(send, group):
        send = send.cpu()
    recv = torch.empty(out_numel, dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return recv.to(device)


def seq_to_head_all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Ulysses input exchange: ``[B, S_local, H, D]`` → ``[B, S_local·W, H/W, D]``.

    Rank r keeps head slice r of every rank's sequence chunk, chunks in rank order.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return x
    b, s, h, d = x.shape
    if h % world:
        raise ValueError(f"{h} heads cannot be split over a Ulysses degree of {world}")
    send = x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = _all_to_all_flat(send.reshape(-1), group, send.numel(), None, None)
    recv = recv.view(world, b, s, h // world, d)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def head_to_seq_all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Ulysses output exchange, the inverse of ``seq_to_head_all_to_all``."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    b, s_full, h_local, d = x.shape
    if s_full % world:
        raise ValueError(f"sequence of {s_full} tokens cannot be split over {world} ranks")
    s = s_full // world
    send = x.reshape(b, world, s, h_local, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = _all_to_all_flat(send.reshape(-1), group, send.numel(), None, None)
    recv = recv.view(world, b, s, h_local, d)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, world * h_local, d)


def seq_to_head_all_to_all_varlen(x: Tensor, seq_lens: Sequence[int], group: dist.ProcessGroup) -> Tensor:
    """Uneven Ulysses input exchange: rank r contributes its first ``seq_lens[r]`` tokens.

    Returns ``[B, sum(seq_lens), H/W, D]``: every rank's valid tokens, in rank order.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, _, h, d = x.shape
    hl = h // world
    mine = seq_lens[rank]
    send = x[:, :mine].reshape(b, mine, world, hl, d).permute(2, 0, 1, 3, 4).contiguous()
    unit = b * hl * d
    in_splits = [mine * unit] * world
    out_splits = [n * unit for n in seq_lens]
    recv = _all_to_all_flat(send.reshape(-1), group, sum(out_splits), in_splits, out_splits)
    parts = [p.view(b, n, hl, d) for p, n in zip(recv.split(out_splits), seq_lens)]
    return torch.cat(parts, dim=1)


def head_to_seq_all_to_all_varlen(x: Tensor, seq_lens: Sequence[int], padded_len: int, group: dist.ProcessGroup) -> Tensor:
    """Inverse of the varlen exchange; the result is zero-padded back to ``padded_len`` tokens."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, _, hl, d = x.shape
    mine = seq_lens[rank]
    send = torch.cat([p.reshape(-1) for p in x.split(list(seq_lens), dim=1)])
    unit = b * hl * d
    in_splits = [n * unit for n in seq_lens]
    out_splits = [mine * unit] * world
    recv = _all_to_all_flat(send.contiguous(), group, sum(out_splits), in_splits, out_splits)
    out = recv.view(world, b, mine, hl, d).permute(1, 2, 0, 3, 4).reshape(b, mine, world * hl, d)
    if padded_len > mine:
        out = torch.cat([out, out.new_zeros(b, padded_len - mine, world * hl, d)], dim=1)
    return out


def all_gather(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    device = x.device
    src = x.contiguous().cpu() if _needs_staging(x, group) else x.contiguous()
    parts = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(parts, src, group=group)
    return torch.cat(parts, dim=dim).to(device)


def all_gather_object_list(value: object, group: dist.ProcessGroup) -> list[object]:
    """Small Python values (lengths, flags) from every rank."""
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def ring_shift(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """Send each tensor to the next rank of the ring and receive the previous rank's."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return list(tensors)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    device = tensors[0].device
    staged = _needs_staging(tensors[0], group)
    sends = [(t.cpu() if staged else t).contiguous() for t in tensors]
    recvs = [torch.empty_like(t) for t in sends]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sends] + [dist.P2POp(dist.irecv, t, prv, group) for t in recvs]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return [t.to(device) for t in recvs]
