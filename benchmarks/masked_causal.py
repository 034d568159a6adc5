"""Masked causal attention for a right-padded batch: sglang's per-row loop vs one masked call.

    python benchmarks/masked_causal.py [--device cpu] [--dtype float32] [--seq 512] [--heads 16]
        [--kv-heads 8] [--head-dim 128] [--lengths 512,77,300,12,450,128,256,1] [--reps 7]

The loop is sglang PR #24008's ``_masked_causal_attention`` (per row: causal over the valid tokens,
non-causal for the padding), through SDPA; the other side is the encoder's ``MaskedCausalAttention``,
one SDPA call with a ``[B, 1, S, S]`` mask built once per forward (its build time printed apart). Both
run interleaved; medians and their ratio are printed, and outputs that disagree beyond the dtype's
bound exit 1. Figures (H200, CPU): docs/measured.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from reference_impl.attention.backends import expand_kv_heads
from reference_impl.forward_context import set_forward_context
from reference_impl.models.qwen3 import CausalMaskPlan, MaskedCausalAttention

Tensor = torch.Tensor
AGREEMENT_BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def per_row_loop(q: Tensor, k: Tensor, v: Tensor, lengths: list[int]) -> Tensor:
    """The seed's algorithm on ``[B, S, H, D]``: per row, causal over the valid part, padding rows over valid keys."""
    batch, seq = q.shape[:2]
    if all(n == seq for n in lengths):
        k_all, v_all = expand_kv_heads(k, v, q.shape[2])
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2), is_causal=True
        ).transpose(1, 2)
    out = torch.zeros_like(q)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        kb, vb = expand_kv_heads(k[b : b + 1, :n], v[b : b + 1, :n], q.shape[2])
        kt, vt = kb.transpose(1, 2), vb.transpose(1, 2)
        out[b : b + 1, :n] = F.scaled_dot_product_attention(
            q[b : b + 1, :n].transpose(1, 2), kt, vt, is_causal=True
        ).transpose(1, 2)
        if n < seq:
            out[b : b + 1, n:] = F.scaled_dot_product_attention(q[b : b + 1, n:].transpose(1, 2), kt, vt).transpose(
                1, 2
            )
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> tuple[float, Tensor]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--lengths", default="512,77,300,12,450,128,256,1")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lengths = [int(n) for n in args.lengths.split(",")]
    if any(n < 0 or n > args.seq for n in lengths):
        parser.error(f"--lengths must lie in [0, {args.seq}]")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(lengths), args.seq, args.heads, args.head_dim, generator=gen).to(device, dtype)
    k = torch.randn(len(lengths), args.seq, args.kv_heads, args.head_dim, generator=gen).to(device, dtype)
    v = torch.randn(len(lengths), args.seq, args.kv_heads, args.head_dim, generator=gen).to(device, dtype)
    lengths_t = torch.tensor(lengths, device=device)
    with torch.device(device):
        attn = MaskedCausalAttention(args.heads, args.head_dim, args.kv_heads, dtype, "text_encoder")

    loop_ms: list[float] = []
    vec_ms: list[float] = []
    plan_ms: list[float] = []
    with torch.no_grad(), set_forward_context():
        for rep in range(args.warmup + args.reps):
            t_plan, plan = _timed(lambda: CausalMaskPlan.from_lengths(lengths_t, args.seq), device)
            t_vec, out_vec = _timed(lambda: attn(q, k, v, plan), device)
            t_loop, out_loop = _timed(lambda: per_row_loop(q, k, v, lengths), device)
            if rep >= args.warmup:
                loop_ms.append(t_loop)
                vec_ms.append(t_vec)
                plan_ms.append(t_plan)

    max_abs = (out_vec.double() - out_loop.double()).abs().max().item()
    bound = AGREEMENT_BOUND[dtype]
    loop, vec, plan_t = statistics.median(loop_ms), statistics.median(vec_ms), statistics.median(plan_ms)
    print(
        f"device={device} dtype={args.dtype} B={len(lengths)} S={args.seq} H={args.heads} KV={args.kv_heads} "
        f"D={args.head_dim} lengths={lengths} threads={torch.get_num_threads()} backend={attn.masked.backend.value} "
        f"reps={args.reps}"
    )
    print(f"per-row loop (seed)      median {loop:9.3f} ms   (min {min(loop_ms):.3f}, max {max(loop_ms):.3f})")
    print(f"one masked call (ours)   median {vec:9.3f} ms   (min {min(vec_ms):.3f}, max {max(vec_ms):.3f})")
    print(f"mask build, once/forward median {plan_t:9.3f} ms")
    print(f"loop / masked = {loop / vec:.2f}x   (loop / (masked + mask build) = {loop / (vec + plan_t):.2f}x)")
    print(f"agreement: max abs {max_abs:.3e} (bound {bound:g}) -> {'ok' if max_abs <= bound else 'FAIL'}")
    return 0 if max_abs <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
