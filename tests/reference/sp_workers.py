"""Per-rank workers for the layer guards that no contract reaches (module level, so spawn can
pickle them). Parity itself is checked by the contracts in harness/contracts/usp.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference_impl import USPAttention, set_forward_context
from reference_impl.attention.backends import TorchSDPABackend
from reference_impl.parallel import destroy_sequence_parallel, init_sequence_parallel


def guard_worker(case: str) -> str:
    """Run one refused call; return the exception's type and message, then prove the group is alive."""
    world = dist.get_world_size()
    ring = 2 if case == "ring_admission" else 1
    result = "no error"
    original = TorchSDPABackend.supports_ring_rotation
    if case == "ring_admission":
        # Pretend the SDPA kernel lacks the LSE, so the admission check in USPAttention is what runs.
        TorchSDPABackend.supports_ring_rotation = classmethod(lambda cls: False)  # type: ignore[method-assign]
    init_sequence_parallel(world // ring, ring)
    try:
        with set_forward_context():
            if case == "ring_admission":
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
