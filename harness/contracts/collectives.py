"""How many collectives an attention layer made, counted at the dispatcher as PyTorch's CommDebugMode does.

Every torch.distributed call (c10d's in-place ops and the functional collectives) reaches the
dispatcher, whatever the backend, so a dispatch mode sees the layer's exchanges without its code
being touched. CommDebugMode counts collectives only; this counts sends and receives too (a ring's
steps). Only the layer's own calls under sequence parallelism are counted (:func:`counting_calls` inside
:func:`recording`), never the contract's set-up or its single-rank reference.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# dispatcher op name (its schema's, overload dropped) -> the kind a figure counts
_KINDS = {
    "c10d::alltoall_base_": "all_to_all", "c10d::alltoall_": "all_to_all",
    "_c10d_functional::all_to_all_single": "all_to_all",
    "c10d::allgather_": "all_gather", "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather", "c10d::allgather_coalesced_": "all_gather",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::all_gather_into_tensor_coalesced": "all_gather",
    "c10d::allreduce_": "all_reduce", "c10d::allreduce_coalesced_": "all_reduce",
    "_c10d_functional::all_reduce": "all_reduce", "_c10d_functional::all_reduce_coalesced": "all_reduce",
    "c10d::reduce_scatter_": "reduce_scatter", "c10d::_reduce_scatter_base_": "reduce_scatter",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "c10d::broadcast_": "broadcast", "_c10d_functional::broadcast": "broadcast",
    "c10d::send": "send", "c10d::recv_": "recv", "c10d::recv_any_source_": "recv",
    "c10d::barrier": "barrier",
}
KINDS = tuple(dict.fromkeys(_KINDS.values()))


class _Counting(TorchDispatchMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kind = _KINDS.get(func._schema.name)  # noqa: SLF001 - the op's qualified name, as its schema spells it
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


_active: ContextVar[Counter[str] | None] = ContextVar("parity_collective_counts", default=None)


@contextmanager
def recording(counts: Counter[str]) -> Iterator[None]:
    """Add to ``counts`` the collectives of every layer call made in the block (``calls``: how many calls)."""
    token = _active.set(counts)
    try:
        yield
    finally:
        _active.reset(token)


@contextmanager
def counting_calls() -> Iterator[None]:
    """One layer call: its collectives added to the recording in effect (none: nothing is counted)."""
    counts = _active.get()
    if counts is None:
        yield
        return
    counts["calls"] += 1
    with _Counting(counts):
        yield


class Counted:
    """An attention whose calls are counted (:func:`counting_calls`); everything else is the attention's own."""

    def __init__(self, attention: Callable[..., Any]) -> None:
        self._attention = attention

    def __getattr__(self, name: str) -> Any:
        return getattr(self._attention, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with counting_calls():
            return self._attention(*args, **kwargs)


def figures(counts: Counter[str]) -> dict[str, int]:
    """The counts as a figure: the number of calls and each kind the calls made."""
    return {"calls": counts["calls"], **{kind: counts[kind] for kind in KINDS if counts[kind]}}
