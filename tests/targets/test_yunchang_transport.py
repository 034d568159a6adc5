"""The gloo transport shim for yunchang's ring (harness/targets/yunchang_transport.py) on real gloo groups:
staged transfers are byte-identical to yunchang's own, and a planted rank-order swap is not."""

from __future__ import annotations

import pytest
import torch

from harness.targets.yunchang import LACKS, YunchangTarget, has_flash_attn_2
from tests.targets import yunchang_transport_workers as workers

pytest.importorskip("yunchang", reason="yunchang is not installed (pip install yunchang==0.6.4)")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_staged_ring_transfers_are_byte_identical_to_yunchangs_own(rank_pool, world: int) -> None:
    direct = rank_pool(world).run(workers.ring_hops, "direct")
    assert rank_pool(world).run(workers.ring_hops, "staged") == direct
    started = [[t.view(torch.uint8).numpy().tobytes() for t in workers.start(r)] for r in range(world)]
    assert direct == [[started[(r - hop) % world] for hop in (1, 2, 3)] for r in range(world)]  # r - h's, hop h


@pytest.mark.parametrize(("world", "caught"), [(2, False), (3, True), (4, True)])
def test_a_rank_order_swap_in_the_staged_transfer_is_seen_from_ring_degree_3(
    rank_pool, world: int, caught: bool
) -> None:
    """At ring degree 2 the next and the previous rank are one rank: no transfer can tell the directions apart."""
    direct = rank_pool(world).run(workers.ring_hops, "direct")
    assert (rank_pool(world).run(workers.ring_hops, "reversed") != direct) == caught


def test_what_yunchang_lacks_is_said_from_its_own_code() -> None:
    """Without flash-attn's 2.x API yunchang cannot differentiate: its torch backward raises (the fact the
    undeclared `backward` quotes), and a case needing it says so."""
    from yunchang.kernels.attention import pytorch_attn_backward

    if has_flash_attn_2():
        pytest.skip("flash-attn's 2.x API is installed: yunchang differentiates through it")
    with pytest.raises(RuntimeError, match="Not implemented backward for PyTorch attention types"):
        pytorch_attn_backward(*[torch.zeros(1)] * 6)
    target = YunchangTarget()
    assert "backward" not in target.capabilities() and target.lacks_because() == LACKS
