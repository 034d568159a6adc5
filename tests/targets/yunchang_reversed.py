"""yunchang whose staged ring transfers run the ring the wrong way round (the planted rank-order swap of
tests/targets/yunchang_transport_workers.py), for the GPU run: its ring cases from ring degree 3 must fail.

    parity check 'usp.ring_*' --target tests.targets.yunchang_reversed:factory --device cuda
"""

from __future__ import annotations

from harness.targets import yunchang_transport
from harness.targets.yunchang import YunchangTarget
from tests.targets.yunchang_transport_workers import reversed_commit


class ReversedRingYunchang(YunchangTarget):
    def init_parallel(self, ulysses_degree: int, ring_degree: int) -> None:
        super().init_parallel(ulysses_degree, ring_degree)
        yunchang_transport.stage_ring_transfers(reversed_commit)


def factory() -> ReversedRingYunchang:
    return ReversedRingYunchang()
