"""USPAttention single-rank path vs the raw SDPA kernel, side by side in one run.

    python benchmarks/usp_overhead.py [--device cuda] [--seq 4608] [--heads 24] [--head-dim 128]

Target (issue 9): overhead <= 5% at B=1, 24 heads, 4096+512 tokens, head dim 128, bf16.
"""

from __future__ import annotations

import argparse
import json

import torch

from harness.targets.reference.kernels import AttnShape, matmul_tflops, usp_overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=4096 + 512)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shape = AttnShape(seq=args.seq, heads=args.heads, head_dim=args.head_dim)
    result = usp_overhead(shape, dtype, args.device)
    result["matmul"] = matmul_tflops(args.device, dtype)
    result["fraction_of_matmul_rate"] = result["usp_tflops"] / result["matmul"]["tflops"]
    print(json.dumps(result, indent=2))
    print(
        f"raw SDPA [B,H,S,D] {result['raw_sdpa_ms']:.3f} ms | raw SDPA on [B,S,H,D] views "
        f"{result['raw_sdpa_same_layout_ms']:.3f} ms | USPAttention {result['usp_ms']:.3f} ms\n"
        f"USPAttention / raw = {result['usp_ms'] / result['raw_sdpa_ms']:.3f} ({result['overhead_pct']:+.2f}%); "
        f"/ raw same layout = {result['usp_ms'] / result['raw_sdpa_same_layout_ms']:.3f} "
        f"({result['layer_overhead_pct']:+.2f}%)"
    )


if __name__ == "__main__":
    main()
