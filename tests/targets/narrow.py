"""A user's target that declares only Ulysses and backward (parity's reference layer underneath, so what it
runs is correct), under a name no overlay ships for: what a correct, narrow target sees on the default cases."""

from __future__ import annotations

from harness.targets.base import Capability
from harness.targets.reference.attention import ReferenceTarget


class NarrowTarget(ReferenceTarget):
    name = "narrow"

    def capabilities(self) -> frozenset[str]:
        return frozenset({Capability.ULYSSES, Capability.BACKWARD})


def factory() -> NarrowTarget:
    return NarrowTarget()
