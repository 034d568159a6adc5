"""Sequence-parallel process-group state and the collectives USPAttention uses."""

from reference_impl.parallel.state import (
    destroy_sequence_parallel,
    get_ring_group,
    get_ring_rank,
    get_ring_world_size,
    get_sp_rank,
    get_sp_world_size,
    get_ulysses_group,
    get_ulysses_rank,
    get_ulysses_world_size,
    init_sequence_parallel,
    sequence_parallel_initialized,
)

__all__ = [
    "destroy_sequence_parallel",
    "get_ring_group",
    "get_ring_rank",
    "get_ring_world_size",
    "get_sp_rank",
    "get_sp_world_size",
    "get_ulysses_group",
    "get_ulysses_rank",
    "get_ulysses_world_size",
    "init_sequence_parallel",
    "sequence_parallel_initialized",
]
