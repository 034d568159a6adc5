"""The sequence-parallel group of size W = ulysses_degree × ring_degree.

Ranks are laid out Ulysses-inner: global rank = ring_rank · U + ulysses_rank. A Ulysses group
is U consecutive ranks, so its all-to-all gathers one contiguous segment of the sequence, and
ring rank j holds segment j: the order causal ring attention relies on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class SequenceParallelState:
    world_size: int
    rank: int
    ulysses_degree: int
    ring_degree: int
    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses_degree

    @property
    def ring_rank(self) -> int:
        return self.rank // self.ulysses_degree


_state: SequenceParallelState | None = None


def init_sequence_parallel(ulysses_degree: int, ring_degree: int = 1) -> SequenceParallelState:
    """Build the Ulysses and ring sub-groups; every rank of the default group must call it."""
    global _state
    if not dist.is_initialized():
        raise RuntimeError("init_sequence_parallel needs torch.distributed.init_process_group() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if ulysses_degree < 1 or ring_degree < 1 or ulysses_degree * ring_degree != world:
        raise ValueError(
            f"ulysses_degree ({ulysses_degree}) × ring_degree ({ring_degree}) must equal the world size ({world})"
        )
    if _state is not None:
        destroy_sequence_parallel()
    ulysses_group = ring_group = None
    # new_group is collective: every rank creates every group, keeps its own.
    for r in range(ring_degree):
        ranks = list(range(r * ulysses_degree, (r + 1) * ulysses_degree))
        group = dist.new_group(ranks)
        if rank in ranks:
            ulysses_group = group
    for u in range(ulysses_degree):
        ranks = list(range(u, world, ulysses_degree))
        group = dist.new_group(ranks)
        if rank in ranks:
            ring_group = group
    assert ulysses_group is not None and ring_group is not None
    _state = SequenceParallelState(world, rank, ulysses_degree, ring_degree, ulysses_group, ring_group)
    return _state


def destroy_sequence_parallel() -> None:
    """Forget the sub-groups; they are destroyed with the default group.

    Destroying gloo sub-groups here made the next ``new_group`` fail now and then ("Connection
    closed by peer" in connectFullMesh), so a long-lived pool keeps them until it closes: on NCCL
    each keeps a communicator, a cost to watch in long pools.
    """
    global _state
    _state = None


def sequence_parallel_initialized() -> bool:
    return _state is not None


def get_sp_world_size() -> int:
    return _state.world_size if _state else 1


def get_sp_rank() -> int:
    return _state.rank if _state else 0


def get_ulysses_world_size() -> int:
    return _state.ulysses_degree if _state else 1


def get_ulysses_rank() -> int:
    return _state.ulysses_rank if _state else 0


def get_ring_world_size() -> int:
    return _state.ring_degree if _state else 1


def get_ring_rank() -> int:
    return _state.ring_rank if _state else 0


def get_ulysses_group() -> dist.ProcessGroup:
    if _state is None:
        raise RuntimeError("sequence parallelism is not initialized (call init_sequence_parallel)")
    return _state.ulysses_group


def get_ring_group() -> dist.ProcessGroup:
    if _state is None:
        raise RuntimeError("sequence parallelism is not initialized (call init_sequence_parallel)")
    return _state.ring_group
