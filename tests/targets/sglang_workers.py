"""Rank functions for tests/targets/test_sglang.py (module level, so the rank pool can pickle them)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from harness.contracts.oracles import attention_ref64
from harness.targets.base import AttentionSpec, Target, Unsupported
from harness.targets.loader import load_target
from harness.targets.spec import TargetSpec

SPEC = AttentionSpec(num_heads=4, head_dim=32, dtype=torch.bfloat16)
TOKENS, REPLICATED = 16, 4


def _qkv(tokens: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)  # the same on every rank
    return tuple(torch.randn(1, tokens, 4, 32, generator=gen).to(dtype) for _ in range(3))


def _refusal(target: Target, degrees: tuple[int, int], call: Callable[[], object]) -> tuple[str, str] | None:
    target.init_parallel(*degrees)
    try:
        call()
        return None
    except Unsupported as exc:
        return exc.kind, exc.reason
    finally:
        target.destroy_parallel()


def refusals() -> dict[str, tuple[str, str] | None]:
    """How each sglang refusal reaches the harness: (kind, reason), or None when the call ran."""
    target, world = load_target(TargetSpec("sglang")), dist.get_world_size()
    q, k, v = _qkv(TOKENS + REPLICATED)
    key_mask = torch.ones(1, TOKENS + REPLICATED, dtype=torch.bool)
    found = {"ring": _refusal(target, (1, world), lambda: target.make_attention(SPEC))}
    for kwarg in ("num_replicated_prefix", "num_replicated_suffix", "num_replicated_kv_prefix"):
        found[kwarg] = _refusal(
            target, (world, 1), lambda: target.make_attention(SPEC)(q, k, v, attn_mask=key_mask, **{kwarg: REPLICATED})
        )
    dense = torch.ones(1, 4, TOKENS * world, TOKENS * world, dtype=torch.bool)
    found["dense_mask"] = _refusal(
        target,
        (world, 1),
        lambda: target.make_attention(SPEC)(q[:, :TOKENS], k[:, :TOKENS], v[:, :TOKENS], attn_mask=dense),
    )
    found["sdpa_kernel"] = _refusal(target, (world, 1), lambda: target.make_attention(SPEC.with_(sdpa_kernel="math")))
    return found


class CrashingLayer:
    """A patched layer whose constructor fails under ring for its own reason (a bug, an OOM): not a refusal."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA out of memory (a crash, not sglang's ring admission)")

    def forward(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("never built")


def crash_under_ring() -> str:
    """What a crashing layer's constructor becomes under ring: the kind of refusal, or the exception's type."""
    target = load_target(TargetSpec("sglang", (("layer", f"{__name__}:CrashingLayer"),)))
    try:
        found = _refusal(target, (1, dist.get_world_size()), lambda: target.make_attention(SPEC))
    except RuntimeError as exc:
        return type(exc).__name__
    return f"refusal {found}"


def causal_with_mask() -> dict[str, float]:
    """sglang's causal layer with and without an all-true key mask, one rank and under SP, against float64 oracles."""
    target, world, rank = load_target(TargetSpec("sglang")), dist.get_world_size(), dist.get_rank()
    spec = AttentionSpec(num_heads=4, head_dim=32, causal=True, dtype=torch.float32)
    total = TOKENS * world
    q, k, v = _qkv(total, torch.float32)
    everything = torch.ones(1, total, dtype=torch.bool)
    causal, plain = attention_ref64(q, k, v, causal=True), attention_ref64(q, k, v, causal=False)
    local = target.make_attention(spec.with_(skip_sequence_parallel=True))
    figures = {}
    for label, out in (("one_rank_no_mask", local(q, k, v)), ("one_rank_mask", local(q, k, v, attn_mask=everything))):
        figures[f"{label}_vs_causal"] = float((out.double() - causal).abs().max())
        figures[f"{label}_vs_non_causal"] = float((out.double() - plain).abs().max())
    sl = slice(rank * TOKENS, (rank + 1) * TOKENS)
    target.init_parallel(world, 1)
    try:
        out = target.make_attention(spec)(q[:, sl], k[:, sl], v[:, sl], attn_mask=everything[:, sl])
    finally:
        target.destroy_parallel()
    figures["sp_mask_vs_causal"] = float((out.double() - causal[:, sl]).abs().max())
    figures["sp_mask_vs_non_causal"] = float((out.double() - plain[:, sl]).abs().max())
    return figures


def autograd_graphs() -> dict[str, bool]:
    """Which outputs carry an autograd graph: the layer's on one rank and under Ulysses, and sglang's exchange alone."""
    from sglang.multimodal_gen.runtime.layers import usp

    target, world = load_target(TargetSpec("sglang")), dist.get_world_size()
    q, k, v = (t.float().requires_grad_() for t in _qkv(TOKENS))
    seen = {}
    for label, degrees in (("one_rank", (1, 1)), ("ulysses", (world, 1))):
        target.init_parallel(*degrees)
        try:
            seen[label] = target.make_attention(SPEC.with_(dtype=torch.float32))(q, k, v).grad_fn is not None
            if label == "ulysses":
                seen["exchange"] = usp._usp_all_to_all_single(q * 1.0).grad_fn is not None
        finally:
            target.destroy_parallel()
    return seen
