"""The rules a plug-in target must keep, checked where they are first used, each broken one named.

A target written against the interface by someone else fails in the harness's internals otherwise
(an ``AttributeError`` deep in a contract for a missing ``kernel``, a ``TypeError`` on a tuple where
the output was expected): the user reads which rule their target broke instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from harness.targets.base import Attention, Target


class InterfaceError(TypeError):
    """A target broke the Target / Attention interface; the message names the rule and the target."""


def check_capabilities(target: Target) -> frozenset[str]:
    """``capabilities()`` returns a set of capability names (a bare string would read as its letters)."""
    caps = target.capabilities()
    if isinstance(caps, (str, bytes)) or not isinstance(caps, (set, frozenset, tuple, list)):
        raise InterfaceError(
            f"target {target.name!r}: capabilities() must return a frozenset of capability names, "
            f"not {type(caps).__name__}"
        )
    if not all(isinstance(c, str) for c in caps):
        raise InterfaceError(f"target {target.name!r}: capabilities() must hold strings, got {sorted(map(repr, caps))}")
    return frozenset(caps)


def checked_attention(attention: object, target: Target) -> Attention:
    """``attention`` as built by ``target.make_attention``, held to the Attention protocol on every call."""
    where = f"target {target.name!r}: make_attention() returned {type(attention).__name__}"
    if attention is None or not callable(attention):
        raise InterfaceError(
            f"{where}, which is not callable: it must return an attention, called as attention(q, k, v)"
        )
    for name in ("backend", "kernel"):
        value = getattr(attention, name, None)
        if not isinstance(value, str):
            got = "has none" if value is None else f"is {type(value).__name__}"
            raise InterfaceError(
                f"{where}, whose .{name} {got}: an attention names its {name} as a str (reports print which kernel ran)"
            )
    return _Checked(attention, where)  # type: ignore[arg-type]


class _Checked:
    """Delegates to the target's attention; an output that is not one tensor is named as the broken rule."""

    def __init__(self, inner: Callable[..., Any], where: str) -> None:
        self._inner, self._where = inner, where

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = self._inner(q, k, v, **kwargs)
        if isinstance(out, torch.Tensor):
            return out
        shape = f" of {len(out)}" if isinstance(out, (tuple, list)) else ""
        raise InterfaceError(
            f"{self._where}, whose call returned a {type(out).__name__}{shape}: attention(q, k, v) "
            "returns the output tensor alone, [B, S_local, H, D] (return an LSE, if any, elsewhere)"
        )
