"""The per-forward context that attention layers read (timestep, attention metadata).

Layers fail with a clear message outside ``set_forward_context`` rather than silently running
with stale or missing metadata: that is how sglang's VAE decode bug showed up (seed 000).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ForwardContext:
    current_timestep: int = 0
    attn_metadata: Any = None


_context: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("parity_forward_context", default=None)


@contextmanager
def set_forward_context(current_timestep: int = 0, attn_metadata: Any = None) -> Iterator[ForwardContext]:
    """Make a forward context current for the duration of the block (nestable)."""
    ctx = ForwardContext(current_timestep, attn_metadata)
    token = _context.set(ctx)
    try:
        yield ctx
    finally:
        _context.reset(token)


def get_forward_context(needed_by: str = "this layer") -> ForwardContext:
    """Return the current context, or raise naming the layer that needed it."""
    ctx = _context.get()
    if ctx is None:
        raise RuntimeError(
            f"{needed_by} needs a forward context but none is set: wrap the call in "
            "`with reference_impl.set_forward_context(current_timestep=..., attn_metadata=...):`"
        )
    return ctx
