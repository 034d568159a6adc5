"""Collectives for sequence parallelism, on NCCL or gloo, differentiable.

gloo has ``all_to_all_single`` but no list ``all_to_all`` and cannot move CUDA tensors for every op;
when the group is gloo and a tensor is on a GPU (ranks sharing one), it is staged through host
memory, which is exact. Every collective is an autograd Function whose backward is its adjoint (an
all-to-all reversed, a ring shift back). Replicated tensors keep one rule both ways, as in
Megatron's tensor parallelism: their gradient is whole and identical on every rank, so
``all_gather`` of a replicated output hands each rank its slice of the gradient, ``split`` of a
replicated input gathers the slices back, and ``replicated_input`` sums the partial gradients of a
replicated tensor each rank used for its own part (its queries, its K/V shard).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def _needs_staging(tensor: Tensor, group: dist.ProcessGroup) -> bool:
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


def _all_to_all_raw(
    send: Tensor, group: dist.ProcessGroup, out_numel: int, in_splits: list[int] | None, out_splits: list[int] | None
) -> Tensor:
    """all_to_all_single on a 1-D contiguous buffer, staged through the host when needed."""
    device = send.device
    if _needs_staging(send, group):
        send = send.cpu()
    recv = torch.empty(out_numel, dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return recv.to(device)


class _AllToAll(torch.autograd.Function):
    """The adjoint of an all-to-all is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, send, group, out_numel, in_splits, out_splits):  # type: ignore[override]
        ctx.group, ctx.in_numel, ctx.splits = group, send.numel(), (in_splits, out_splits)
        return _all_to_all_raw(send, group, out_numel, in_splits, out_splits)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        in_splits, out_splits = ctx.splits
        return (
            _all_to_all_raw(grad.contiguous(), ctx.group, ctx.in_numel, out_splits, in_splits),
            None,
            None,
            None,
            None,
        )


def _all_to_all_flat(
    send: Tensor, group: dist.ProcessGroup, out_numel: int, in_splits: list[int] | None, out_splits: list[int] | None
) -> Tensor:
    return _AllToAll.apply(send, group, out_numel, in_splits, out_splits)


def seq_to_head_all_to_all(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """Ulysses input exchange of Q, K and V in one all-to-all: each ``[B, S_local, H, D]`` →
    ``[B, S_local·W, H/W, D]`` (their token and head counts may differ: GQA, a K/V prefix kept aside).

    Rank r keeps head slice r of every rank's sequence chunk, chunks in rank order. One collective for
    the three, as sglang's USPAttention stacks them: a layer's cost is its exchanges' latency, not bytes.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return list(tensors)
    sends = []
    for x in tensors:
        b, s, h, d = x.shape
        if h % world:
            raise ValueError(f"{h} heads cannot be split over a Ulysses degree of {world}")
        sends.append(x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).reshape(world, -1))
    widths = [t.shape[1] for t in sends]
    send = torch.cat(sends, dim=1).contiguous()
    recv = _all_to_all_flat(send.reshape(-1), group, send.numel(), None, None).view(world, -1)
    out = []
    for x, part in zip(tensors, recv.split(widths, dim=1)):
        b, s, h, d = x.shape
        out.append(part.reshape(world, b, s, h // world, d).permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d))
    return out


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


def seq_to_head_all_to_all_varlen(
    tensors: Sequence[Tensor], seq_lens: Sequence[int], group: dist.ProcessGroup
) -> list[Tensor]:
    """Uneven Ulysses input exchange of Q, K and V in one all-to-all: rank r contributes its first
    ``seq_lens[r]`` tokens of each. Returns each as ``[B, sum(seq_lens), H/W, D]``: every rank's valid
    tokens, in rank order."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = seq_lens[rank]
    units = [x.shape[0] * (x.shape[2] // world) * x.shape[3] for x in tensors]  # elements per token and rank, each
    sends = [
        x[:, :mine]
        .reshape(x.shape[0], mine, world, x.shape[2] // world, x.shape[3])
        .permute(2, 0, 1, 3, 4)
        .reshape(world, -1)
        for x in tensors
    ]
    send = torch.cat(sends, dim=1).contiguous()
    in_splits = [mine * sum(units)] * world
    out_splits = [n * sum(units) for n in seq_lens]
    recv = _all_to_all_flat(send.reshape(-1), group, sum(out_splits), in_splits, out_splits)
    per_source = [chunk.split([n * u for u in units]) for chunk, n in zip(recv.split(out_splits), seq_lens)]
    out = []
    for i, x in enumerate(tensors):
        b, hl, d = x.shape[0], x.shape[2] // world, x.shape[3]
        out.append(torch.cat([parts[i].view(b, n, hl, d) for parts, n in zip(per_source, seq_lens)], dim=1))
    return out


def head_to_seq_all_to_all_varlen(
    x: Tensor, seq_lens: Sequence[int], padded_len: int, group: dist.ProcessGroup
) -> Tensor:
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


def _all_gather_raw(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    device = x.device
    src = x.contiguous().cpu() if _needs_staging(x, group) else x.contiguous()
    parts = [torch.empty_like(src) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, src, group=group)
    return torch.cat(parts, dim=dim).to(device)


def _own_slice(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    per = x.shape[dim] // dist.get_world_size(group)
    return x.narrow(dim, dist.get_rank(group) * per, per).contiguous()


class _AllGather(torch.autograd.Function):
    """Forward: every rank's part, in rank order. Backward: this rank's slice of the replicated gradient."""

    @staticmethod
    def forward(ctx, x, dim, group):  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        return _all_gather_raw(x, dim, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _own_slice(grad, ctx.dim, ctx.group), None, None


class _Split(torch.autograd.Function):
    """Forward: this rank's slice of a replicated tensor. Backward: every rank's slice gradient, gathered."""

    @staticmethod
    def forward(ctx, x, dim, group):  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        return _own_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_gather_raw(grad, ctx.dim, ctx.group), None, None


class _ReplicatedInput(torch.autograd.Function):
    """Forward: the tensor itself. Backward: the ranks' partial gradients summed (all-reduce)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        total = grad.contiguous().cpu() if _needs_staging(grad, ctx.group) else grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.to(grad.device), None


def all_gather(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (a replicated result)."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllGather.apply(x, dim, group)


def split(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """This rank's equal slice of a replicated ``x`` along ``dim`` (the inverse of :func:`all_gather`)."""
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} cannot be split over {world} ranks")
    return x if world == 1 else _Split.apply(x, dim, group)


def replicated_input(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """A replicated ``x`` that each rank uses for its own part of the work: its gradient is summed over ``group``."""
    return x if dist.get_world_size(group) == 1 else _ReplicatedInput.apply(x, group)


def _shift(tensors: Sequence[Tensor], group: dist.ProcessGroup, step: int) -> list[Tensor]:
    """Send each tensor ``step`` ranks on along the ring (+1 or -1) and receive from the other side."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    to = dist.get_global_rank(group, (rank + step) % world)
    frm = dist.get_global_rank(group, (rank - step) % world)
    device = tensors[0].device
    staged = _needs_staging(tensors[0], group)
    sends = [(t.cpu() if staged else t).contiguous() for t in tensors]
    recvs = [torch.empty_like(t) for t in sends]
    ops = [dist.P2POp(dist.isend, t, to, group) for t in sends] + [dist.P2POp(dist.irecv, t, frm, group) for t in recvs]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return [t.to(device) for t in recvs]


class _RingShift(torch.autograd.Function):
    """The adjoint of a shift to the next rank is a shift back to the previous one."""

    @staticmethod
    def forward(ctx, group, *tensors):  # type: ignore[override]
        ctx.group = group
        return tuple(_shift(tensors, group, +1))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, *_shift(grads, ctx.group, -1))


def ring_shift(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """Send each tensor to the next rank of the ring and receive the previous rank's."""
    if dist.get_world_size(group) == 1:
        return list(tensors)
    return list(_RingShift.apply(group, *tensors))


class _Anchor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, *kept):  # type: ignore[override]
        ctx.kept = [(t.shape, t.dtype, t.device) for t in kept]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.kept))


def anchor(out: Tensor, kept: Sequence[Tensor]) -> Tensor:
    """``out``, with ``kept`` in its autograd graph (a zero gradient each).

    A rank that received tensors through a collective but did not use them (a causal ring skips
    the blocks in its future) must still run that collective's backward, or its peers wait for
    it there forever: autograd runs only the backward of what the output depends on.
    """
    kept = [t for t in kept if t.requires_grad]
    return _Anchor.apply(out, *kept) if kept and torch.is_grad_enabled() else out
