"""Per-rank workers for the layer guards that no contract reaches (module level, so spawn can
pickle them). Parity itself is checked by the contracts in harness/contracts/usp.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.ranks import rank_device
from reference_impl import USPAttention, set_forward_context
from reference_impl.attention.backends import TorchSDPABackend
from reference_impl.parallel import destroy_sequence_parallel, init_sequence_parallel

def make_qkv(batch: int, seq: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """Seeded on the CPU (identical on every rank and device), then moved to this rank's device."""
    gen = torch.Generator().manual_seed(seed)
    device = rank_device()
    return tuple(torch.randn(batch, seq, h, dim, generator=gen).to(device, dtype) for h in (heads, kv_heads, kv_heads))


def guard_worker(case: str) -> str:
    """Run one refused call; return the exception's type and message, then prove the group is alive."""
    world = dist.get_world_size()
    ring = 2 if case in ("replicated_with_ring", "ring_admission") else 1
    q, k, v = make_qkv(1, 8, 4, 4, 8, torch.float32, 0)
    result = "no error"
    original = TorchSDPABackend.supports_ring_rotation
    if case == "ring_admission":
        # Pretend the SDPA kernel lacks the LSE, so the admission check in USPAttention is what runs.
        TorchSDPABackend.supports_ring_rotation = classmethod(lambda cls: False)  # type: ignore[method-assign]
    init_sequence_parallel(world // ring, ring)
    try:
        with set_forward_context():
            if case == "replicated_with_ring":
                USPAttention(4, 8)(q, k, v, num_replicated_suffix=2)
            elif case == "ring_admission":
                USPAttention(4, 8)
            elif case == "heads":
                USPAttention(3, 8)
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        result = f"{type(exc).__name__}: {exc}"
    finally:
        TorchSDPABackend.supports_ring_rotation = original  # type: ignore[method-assign]
        destroy_sequence_parallel()
    probe = torch.ones(1)
    dist.all_reduce(probe)  # a CPU tensor: gloo serves it even when the ranks share a GPU
    assert probe.item() == world, "group is not healthy after the guard"
    return result
