"""Per-rank workers for the sequence-parallel tests (module level, so spawn can pickle them).

Every rank builds the same seeded full-length inputs, computes the single-rank reference with
sequence parallelism *not* initialized, then initializes it and runs its own shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from harness.launcher import rank_device
from reference_impl import USPAttention, set_forward_context
from reference_impl.attention.backends import MathBackend, TorchSDPABackend
from reference_impl.parallel import destroy_sequence_parallel, init_sequence_parallel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_qkv(batch: int, seq: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """Seeded on the CPU (identical on every rank and device), then moved to this rank's device."""
    gen = torch.Generator().manual_seed(seed)
    device = rank_device()
    return tuple(torch.randn(batch, seq, h, dim, generator=gen).to(device, dtype) for h in (heads, kv_heads, kv_heads))


def _with_sp(ulysses: int, ring: int, body: Callable[[], dict]) -> dict:
    init_sequence_parallel(ulysses, ring)
    try:
        with set_forward_context():
            return body()
    finally:
        destroy_sequence_parallel()


def _figures(out: torch.Tensor, exp: torch.Tensor) -> dict:
    diff = (out.double() - exp.double()).abs()
    return {"bitwise": bool(torch.equal(out, exp)), "max_abs": diff.max().item(), "finite": bool(torch.isfinite(out).all())}


def replicated_worker(tokens_per_rank: int, heads: int, dim: int, rep: int, dtype_name: str, seed: int = 0) -> dict:
    """sglang's parity case: suffix bitwise, prefix against the suffix-ordered reference, kv prefix."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[dtype_name]
    total = tokens_per_rank * world
    q, k, v = make_qkv(1, total + rep, heads, heads, dim, dtype, seed)
    with set_forward_context():
        ref = USPAttention(heads, dim)(q, k, v)
        ref_prefix_order = USPAttention(heads, dim)(*(torch.cat([t[:, total:], t[:, :total]], 1) for t in (q, k, v)))
        ref_kv = USPAttention(heads, dim)(q[:, :total], *(torch.cat([t[:, total:], t[:, :total]], 1) for t in (k, v)))
    sl = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)

    def body() -> dict:
        attn = USPAttention(heads, dim)
        suffix_in = [torch.cat([t[:, sl], t[:, total:]], 1) for t in (q, k, v)]
        out_s = attn(*suffix_in, num_replicated_suffix=rep)
        exp_s = torch.cat([ref[:, sl], ref[:, total:]], 1)
        prefix_in = [torch.cat([t[:, total:], t[:, sl]], 1) for t in (q, k, v)]
        out_p = attn(*prefix_in, num_replicated_prefix=rep)
        exp_p = torch.cat([ref[:, total:], ref[:, sl]], 1)
        exp_p_same_order = torch.cat([ref_prefix_order[:, :rep], ref_prefix_order[:, rep:][:, sl]], 1)
        kv_in = [torch.cat([t[:, total:], t[:, sl]], 1) for t in (k, v)]
        out_kv = attn(q[:, sl], *kv_in, num_replicated_kv_prefix=rep)
        return {
            "suffix": _figures(out_s, exp_s),
            "prefix_vs_suffix_order": _figures(out_p, exp_p),
            "prefix_vs_prefix_order": _figures(out_p, exp_p_same_order),
            "kv_prefix": _figures(out_kv, ref_kv[:, sl]),
        }

    return _with_sp(world, 1, body)


def parity_worker(
    ulysses: int, ring: int, tokens_per_rank: int, heads: int, kv_heads: int, dim: int,
    dtype_name: str, causal: bool, backend: str = "torch_sdpa", seed: int = 0,
) -> dict:
    """Ulysses / ring / hybrid output against the single-rank reference and a float64 oracle."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[dtype_name]
    total = tokens_per_rank * world
    q, k, v = make_qkv(2, total, heads, kv_heads, dim, dtype, seed)
    with set_forward_context():
        ref = USPAttention(heads, dim, num_kv_heads=kv_heads, causal=causal, backend=backend)(q, k, v)
    ref64 = MathBackend().forward(q.double(), k.double(), v.double(), causal=causal)
    sl = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)

    def body() -> dict:
        attn = USPAttention(heads, dim, num_kv_heads=kv_heads, causal=causal, backend=backend)
        out = attn(q[:, sl], k[:, sl], v[:, sl])
        figures = _figures(out, ref[:, sl])
        figures["err64"] = (out.double() - ref64[:, sl]).abs().max().item()
        figures["ref_err64"] = (ref.double() - ref64).abs().max().item()
        return figures

    return _with_sp(ulysses, ring, body)


def varlen_worker(seq_lens: list[int], heads: int, dim: int, dtype_name: str, seed: int = 0) -> dict:
    """Uneven per-rank lengths: compare valid tokens with attention over every rank's valid tokens."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[dtype_name]
    padded = max(seq_lens)
    per_rank = [make_qkv(1, padded, heads, heads, dim, dtype, seed + r) for r in range(world)]
    valid = [torch.cat([per_rank[r][i][:, : seq_lens[r]] for r in range(world)], 1) for i in range(3)]
    with set_forward_context():
        ref = USPAttention(heads, dim)(*valid)
    start = sum(seq_lens[:rank])

    def body() -> dict:
        out = USPAttention(heads, dim)(*per_rank[rank], seq_lens=seq_lens)
        figures = _figures(out[:, : seq_lens[rank]], ref[:, start : start + seq_lens[rank]])
        figures["padding_zero"] = bool((out[:, seq_lens[rank] :] == 0).all())
        return figures

    return _with_sp(world, 1, body)


def masked_worker(tokens_per_rank: int, heads: int, dim: int, dtype_name: str, seed: int = 0) -> dict:
    """A key-padding mask given per rank is gathered; a full 4-D mask is head-sliced."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[dtype_name]
    total = tokens_per_rank * world
    q, k, v = make_qkv(2, total, heads, heads, dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 99)
    key_mask = (torch.rand(2, total, generator=gen) > 0.3).to(q.device)
    key_mask[:, 0] = True
    full_mask = (torch.rand(2, heads, total, total, generator=gen) > 0.4).to(q.device)
    full_mask[..., 0] = True
    with set_forward_context():
        ref_key = USPAttention(heads, dim)(q, k, v, attn_mask=key_mask)
        ref_full = USPAttention(heads, dim)(q, k, v, attn_mask=full_mask)
    sl = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)

    def body() -> dict:
        attn = USPAttention(heads, dim)
        out_key = attn(q[:, sl], k[:, sl], v[:, sl], attn_mask=key_mask[:, sl])
        out_full = attn(q[:, sl], k[:, sl], v[:, sl], attn_mask=full_mask)
        return {"key_mask": _figures(out_key, ref_key[:, sl]), "full_mask": _figures(out_full, ref_full[:, sl])}

    return _with_sp(world, 1, body)


def guard_worker(case: str) -> str:
    """Run one refused call; return the exception's type and message, then prove the group is alive."""
    world = dist.get_world_size()
    ring = 2 if case in ("replicated_with_ring", "ring_admission", "skip_sp_local") else 1
    ulysses = world // ring
    q, k, v = make_qkv(1, 8, 4, 4, 8, torch.float32, 0)
    result = "no error"
    original = TorchSDPABackend.supports_ring_rotation
    if case in ("ring_admission", "skip_sp_local"):
        # Pretend the SDPA kernel lacks the LSE, so the admission check in USPAttention is what runs.
        TorchSDPABackend.supports_ring_rotation = classmethod(lambda cls: False)  # type: ignore[method-assign]
    init_sequence_parallel(ulysses, ring)
    try:
        with set_forward_context():
            if case == "masked_replicated":
                mask = torch.ones(1, 8, dtype=torch.bool, device=q.device)
                USPAttention(4, 8)(q, k, v, attn_mask=mask, num_replicated_suffix=2)
            elif case == "replicated_with_ring":
                USPAttention(4, 8)(q, k, v, num_replicated_suffix=2)
            elif case == "ring_admission":
                USPAttention(4, 8)
            elif case == "heads":
                USPAttention(3, 8)
            elif case == "skip_sp_local":
                attn = USPAttention(4, 8, skip_sequence_parallel=True)
                # Only rank 0 calls it: a hidden collective would hang, the timeout would fire.
                if dist.get_rank() == 0:
                    local = USPAttention(4, 8, skip_sequence_parallel=True)
                    same = torch.equal(attn(q, k, v), TorchSDPABackend().forward(q, k, v)) and local is not None
                    result = f"ran locally, equal={same}"
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        result = f"{type(exc).__name__}: {exc}"
    finally:
        TorchSDPABackend.supports_ring_rotation = original  # type: ignore[method-assign]
        destroy_sequence_parallel()
    probe = torch.ones(1)
    dist.all_reduce(probe)  # a CPU tensor: gloo serves it even when the ranks share a GPU
    assert probe.item() == world, "group is not healthy after the guard"
    return result
