"""Rank functions that show diffusers' divergences directly, against the float64 oracle and one rank.

Run through ``rank_pool(W).run(fn, ...)``; each returns plain figures (JSON-safe) so a test
asserts on numbers, not on a contract's verdict alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.contracts.oracles import attention_ref64, naive_attention
from harness.contracts.params import DTYPES
from harness.targets.base import AttentionSpec, Unsupported
from harness.targets.diffusers import DiffusersTarget

B, S_LOCAL, H, D = 1, 16, 4, 32


def _inputs(
    world: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-length q, k, v and a key-padding mask (key 0 always kept), identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S_LOCAL * world, H, D, generator=gen).to(dtype) for _ in range(3))
    mask = torch.rand(B, S_LOCAL * world, generator=gen) > 0.3
    mask[:, 0] = True
    return q, k, v, mask


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def ring_key_padding(dtype: str) -> dict[str, float]:
    """diffusers' ring (the target's CPU LSE kernel) with a key-padding mask, against what it should and what it does compute."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, mask = _inputs(world, DTYPES[dtype])
    sl = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    target = DiffusersTarget()
    spec = AttentionSpec(H, D, dtype=DTYPES[dtype])
    one_rank = target.make_attention(spec.with_(skip_sequence_parallel=True))(q, k, v, attn_mask=mask)
    target.init_parallel(1, world)
    try:
        ring = target.make_attention(spec)
        out = ring(q[:, sl], k[:, sl], v[:, sl], attn_mask=mask[:, sl])
        unmasked = ring(q[:, sl], k[:, sl], v[:, sl])
    finally:
        target.destroy_parallel()
    tiled = mask[:, sl].repeat(1, world)  # this rank's own mask on every K/V block: what the ring applies
    ref64, ref64_tiled, ref64_unmasked = (attention_ref64(q, k, v, attn_mask=m)[:, sl] for m in (mask, tiled, None))
    return {
        "vs_one_rank": _max_abs(out, one_rank[:, sl]),
        "vs_ref64": _max_abs(out, ref64),
        "vs_ref64_own_mask_tiled": _max_abs(out, ref64_tiled),
        "naive_err_tiled": _max_abs(naive_attention(q, k, v, attn_mask=tiled)[:, sl], ref64_tiled),
        "unmasked_vs_ref64": _max_abs(unmasked, ref64_unmasked),
        "naive_err_unmasked": _max_abs(naive_attention(q, k, v)[:, sl], ref64_unmasked),
        "mask_differs_from_tiled": bool((tiled != mask).any()),
    }


def dense_mask_ulysses(dtype: str) -> dict[str, Any]:
    """A dense mask under Ulysses: per-head [B, H, S, S] raises; the same mask shared over heads ([B, 1, S, S]) works."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = _inputs(world, DTYPES[dtype])
    gen = torch.Generator().manual_seed(3)
    per_head = (torch.rand(B, H, S_LOCAL * world, S_LOCAL * world, generator=gen) > 0.4) | torch.eye(
        S_LOCAL * world, dtype=torch.bool
    )
    shared = per_head[:, :1]
    sl = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    target = DiffusersTarget()
    spec = AttentionSpec(H, D, dtype=DTYPES[dtype])
    local = target.make_attention(spec.with_(skip_sequence_parallel=True))
    one_rank_shared = local(q, k, v, attn_mask=shared)
    target.init_parallel(world, 1)
    try:
        attn = target.make_attention(spec)
        out_shared = attn(q[:, sl], k[:, sl], v[:, sl], attn_mask=shared)
        try:
            attn(q[:, sl], k[:, sl], v[:, sl], attn_mask=per_head)
            per_head_error = None
        except RuntimeError as exc:
            per_head_error = str(exc)
    finally:
        target.destroy_parallel()
    return {
        "per_head_error": per_head_error,
        "shared_bitwise": torch.equal(out_shared, one_rank_shared[:, sl]),
        "shared_vs_ref64": _max_abs(out_shared, attention_ref64(q, k, v, attn_mask=shared)[:, sl]),
    }


def refusal_kinds() -> dict[str, tuple[str, str]]:
    """(kind, reason) of each refusal stock diffusers makes under CP (no LSE kernel): ring on native, causal, GQA."""
    world = dist.get_world_size()
    q = torch.randn(B, S_LOCAL, H, D)
    kv = q[:, :, : H // 2]
    target = DiffusersTarget(lse_kernel="none")
    spec = AttentionSpec(H, D)
    refusals: dict[str, tuple[str, str]] = {}
    for label, degrees, call_spec, k in (
        ("ring", (1, world), spec, q),
        ("causal", (world, 1), spec.with_(causal=True), q),
        ("gqa", (world, 1), spec.with_(num_kv_heads=H // 2), kv),
    ):
        target.init_parallel(*degrees)
        try:
            target.make_attention(call_spec)(q, k, k)
            refusals[label] = ("ran", "")
        except Unsupported as exc:
            refusals[label] = (exc.kind, exc.reason)
        finally:
            target.destroy_parallel()
    return refusals
