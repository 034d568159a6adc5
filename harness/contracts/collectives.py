"""How many collectives an attention layer made: torch.distributed's entry points counted during its calls.

The functions of ``torch.distributed`` and of its functional collectives are wrapped for the length of a
counted call, so a layer's exchanges are seen whatever its code or backend; a dispatch mode (how PyTorch's
CommDebugMode counts) would also see them, but it changes which SDPA path a call takes (a masked CPU call
decomposes differently), and a harness must not change what it measures. Nested calls count once (an
``all_gather_object`` is one all-gather); a ``batch_isend_irecv`` counts its sends and receives. The bytes
each call sends off-rank are added up too (:func:`sent_bytes`). Only the layer's own calls under sequence
parallelism are counted, never the contract's set-up or reference.
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

# function name -> the kind a figure counts, for torch.distributed (c10d) and its functional collectives
_C10D = {
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_object": "all_gather",
    "all_gather_coalesced": "all_gather",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "send": "send",
    "isend": "send",
    "recv": "recv",
    "irecv": "recv",
    "barrier": "barrier",
}
_FUNCTIONAL = {
    "all_to_all_single": "all_to_all",
    "all_to_all_single_autograd": "all_to_all",
    "all_gather_tensor": "all_gather",
    "all_gather_tensor_autograd": "all_gather",
    "all_reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_autograd": "reduce_scatter",
    "broadcast": "broadcast",
}
KINDS = tuple(dict.fromkeys([*_C10D.values(), *_FUNCTIONAL.values()]))
_MODULES = ((dist, _C10D), (c10d, _C10D), (funcol, _FUNCTIONAL))


Kinds = Callable[..., list[str]]  # a call's arguments -> the kinds it counts as
SENT = "sent_bytes"  # the bytes this rank's counted calls sent to other ranks
# The parameter holding what a call sends, by name, across c10d's and the functional collectives' signatures.
_OUTGOING = ("input", "input_tensor_list", "input_tensor", "input_list", "tensor", "tensors", "self")


def _p2p_kinds(p2p_op_list: list[Any], *args: Any, **kwargs: Any) -> list[str]:
    """A ``batch_isend_irecv`` counts as its sends and receives."""
    return ["send" if getattr(op.op, "__name__", "") == "isend" else "recv" for op in p2p_op_list]


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(map(_nbytes, value)) if isinstance(value, (list, tuple)) else 0


def _group(group: Any) -> tuple[int, int]:
    """(size, this rank's index) of a collective's group: a process group, None (the world), or what the
    functional collectives take (ranks, a mesh, a group name)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        group = c10d._resolve_process_group(funcol._resolve_group_name(group))
    return dist.get_world_size(group), dist.get_rank(group)


def sent_bytes(kind: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """What one call of ``fn`` (counted as ``kind``) sends to other ranks, in bytes: an all-to-all every block but
    this rank's own, an all-gather its input to each other rank, an all-reduce 2(W-1)/W of it (a ring's cost), a
    reduce-scatter (W-1)/W, a broadcast W-1 copies from its source, a send its tensor."""
    if kind == "send" and fn.__name__ == "batch_isend_irecv":
        return sum(_nbytes(op.tensor) for op in args[0] if getattr(op.op, "__name__", "") == "isend")
    bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    outgoing = next((bound[name] for name in _OUTGOING if name in bound), None)
    if outgoing is None or kind in ("recv", "barrier"):
        return 0
    size, rank = _group(bound.get("group"))
    if kind == "send":
        return _nbytes(outgoing)
    if isinstance(outgoing, (list, tuple)) and kind in ("all_to_all", "reduce_scatter"):
        return _nbytes(outgoing) - _nbytes(outgoing[rank])
    total = _nbytes(outgoing)
    splits = bound.get("input_split_sizes")
    if kind == "all_to_all" and splits:
        return total * (sum(splits) - splits[rank]) // sum(splits) if sum(splits) else 0
    if kind == "broadcast":
        return total * (size - 1) if dist.get_rank() == bound.get("src", bound.get("group_src")) else 0
    share = {"all_to_all": (size - 1, size), "all_gather": (size - 1, 1), "all_reduce": (2 * (size - 1), size)}
    numerator, denominator = share.get(kind, (size - 1, size))
    return total * numerator // denominator


def _counting(counts: Counter[str], kinds: Kinds, fn: Callable[..., Any], depth: list[int]) -> Callable[..., Any]:
    """``fn`` counting its call and the bytes it sends unless it runs inside another counted call (``depth``)."""

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if not depth[0]:
            made = kinds(*args, **kwargs)
            counts.update(made)
            counts[SENT] += sent_bytes(made[0], fn, args, kwargs) if made else 0
        depth[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] -= 1

    return counted


@contextmanager
def _wrapped(counts: Counter[str]) -> Iterator[None]:
    """torch.distributed's entry points counting into ``counts`` for the block, restored after it. One wrapper
    per function, shared by the modules exporting it (``P2POp`` checks its op is c10d's ``isend`` itself)."""
    depth: list[int] = [0]
    wrappers: dict[int, Callable[..., Any]] = {}
    saved = []
    for module, names in _MODULES:
        entries: list[tuple[str, Kinds]] = [(name, lambda *a, k=kind, **kw: [k]) for name, kind in names.items()]
        if module is not funcol:
            entries.append(("batch_isend_irecv", _p2p_kinds))
        for name, kinds in entries:
            fn = getattr(module, name, None)
            if fn is None:
                continue
            if id(fn) not in wrappers:
                wrappers[id(fn)] = _counting(counts, kinds, fn, depth)
            saved.append((module, name, fn))
            setattr(module, name, wrappers[id(fn)])
    try:
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


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
    with _wrapped(counts):
        yield


class Counted:
    """An attention whose calls are counted (:func:`counting_calls`), each inside ``mode()`` (the case's kernel
    mode); everything else is the attention's own."""

    def __init__(self, attention: Callable[..., Any], mode: Callable[[], AbstractContextManager[None]]) -> None:
        self._attention, self._mode = attention, mode

    def __getattr__(self, name: str) -> Any:
        return getattr(self._attention, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with counting_calls(), self._mode():
            return self._attention(*args, **kwargs)


def made(counts: Counter[str]) -> dict[str, int]:
    """The kinds the counted calls made, each with its count (none made: empty)."""
    return {kind: counts[kind] for kind in KINDS if counts[kind]}


def figures(counts: Counter[str]) -> dict[str, int]:
    """The counts as a figure: the number of calls, each kind the calls made, and the bytes they sent (if any)."""
    return {"calls": counts["calls"], **made(counts), **({SENT: counts[SENT]} if counts[SENT] else {})}
