"""A test target whose ``sage_attn`` slot holds a CPU backend without the LSE.

On the CPU every real backend returns the log-sum-exp, and sage_attn (which does not) is not
installed, so the selector would refuse it before USPAttention's ring admission check could
run. This target puts torch SDPA, declared *without* LSE support, in the sage_attn slot while
it builds a layer: the selection then yields a backend whose ``supports_ring_rotation()`` is
False, and what ``usp.ring_admission`` exercises is the reference layer's own check.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from harness.targets.base import AttentionSpec
from harness.targets.reference import ReferenceAttention, ReferenceTarget
from reference_impl.attention.backends import BACKENDS, AttentionBackendEnum, TorchSDPABackend


class NoLseSdpaBackend(TorchSDPABackend):
    """Torch SDPA posing as a fused kernel that cannot return the LSE (as sage_attn)."""

    enum = AttentionBackendEnum.SAGE_ATTN

    @classmethod
    def supports_ring_rotation(cls) -> bool:
        return False


@contextmanager
def _in_sage_slot() -> Iterator[None]:
    previous = BACKENDS[AttentionBackendEnum.SAGE_ATTN]
    BACKENDS[AttentionBackendEnum.SAGE_ATTN] = NoLseSdpaBackend
    try:
        yield
    finally:
        BACKENDS[AttentionBackendEnum.SAGE_ATTN] = previous


class NoLseBackendTarget(ReferenceTarget):
    name = "no_lse_backend"

    def capabilities(self) -> frozenset[str]:
        return super().capabilities() - {"reference_models"}  # the reference models would not use this attention

    def make_attention(self, spec: AttentionSpec) -> ReferenceAttention:
        with _in_sage_slot():
            return super().make_attention(spec)


def factory() -> NoLseBackendTarget:
    return NoLseBackendTarget()
