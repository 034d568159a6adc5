"""A target over a heavy stack it imports lazily (as sglang's is), declared in ``preload_modules`` so
the stack is imported once in the preloaded server rather than once in every rank."""

from __future__ import annotations

import importlib

from harness.targets.base import AttentionSpec
from harness.targets.reference import ReferenceAttention, ReferenceTarget

STACK = "tests.targets.heavy_stack"


class HeavyTarget(ReferenceTarget):
    name = "heavy"

    def preload_modules(self) -> tuple[str, ...]:
        return (*super().preload_modules(), STACK)

    def make_attention(self, spec: AttentionSpec) -> ReferenceAttention:
        importlib.import_module(STACK)  # where a real target reaches its stack
        return super().make_attention(spec)


def factory() -> HeavyTarget:
    return HeavyTarget()
