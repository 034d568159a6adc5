"""What a contract costs at long sequences, beside the attention kernel's own forward + backward at that shape.

    python benchmarks/oracle_scale.py --device cuda     # 4k to 119k tokens, 24 heads, d128, bf16, W = 2 on one GPU
    python benchmarks/oracle_scale.py                   # CPU: 4k to 16k tokens, 2 heads, d64, fp32

Per total sequence length: torch SDPA's forward + backward on the whole sequence (one process; three runs after a
warm-up: the median, and the ratio's range over their min-max), then ``usp.ulysses_parity`` and ``usp.ulysses_grad`` on the reference target at W = 2
(every rank computes the single-rank reference twice, its shard under SP and the float64 oracle of its rows;
the gradient contract the whole float64 gradients), their wall time as a multiple of the kernel's, and the
most memory one rank held (device: torch's allocator peak; host: resident set). All in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from harness.contracts.case import make_case
from harness.contracts.runner import RunOptions, run_cases
from harness.ranks import PoolSet

GPU_LENGTHS = (4608, 16384, 32768, 65536, 118800)
CPU_LENGTHS = (4096, 8192, 16384)


def kernel_seconds(
    tokens: int, heads: int, dim: int, dtype: torch.dtype, device: str
) -> tuple[list[float], float | None]:
    """SDPA forward + backward on ``[1, heads, tokens, dim]``: the seconds of 3 runs after a warm-up, and the
    device peak in GiB."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, dim, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(1, heads, tokens, dim, generator=gen).to(device, dtype)

    def once() -> float:
        sync()
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v).backward(dout)
        sync()
        return time.perf_counter() - start

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    once()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = sorted(once() for _ in range(3))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return runs, peak


def contract_cost(pools: PoolSet, contract: str, tokens: int, shape: dict, device: str) -> dict:
    case = make_case(contract, {"world_size": 2, "tokens": tokens, **shape}, case_id=f"{contract}@{tokens}", source="b")
    [result] = run_cases([case], RunOptions(device=device, timeout=3600), pools)
    return {
        "status": str(result.status),
        "seconds": result.duration_s,
        "peak_gib_per_rank": result.figures.get("peak_memory_gib", {}),
        "reason": result.reason,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", help="total tokens (default: 4k to 119k on cuda, 16k on cpu)")
    parser.add_argument("--grad-max", type=int, default=None, help="the gradient contract only up to this length")
    parser.add_argument("--json", default=None, help="write the rows as JSON to this file")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    lengths = args.lengths or (GPU_LENGTHS if gpu else CPU_LENGTHS)
    shape = {"heads": 24, "head_dim": 128, "dtype": "bf16"} if gpu else {"heads": 2, "head_dim": 64, "dtype": "fp32"}
    dtype = torch.bfloat16 if gpu else torch.float32
    rows = []
    header = (
        "tokens | kernel fwd+bwd s (min-max of 3) | contract | s | × kernel (× over the kernel's min-max) | "
        "device GiB/rank | host GiB/rank | status"
    )
    print(header, flush=True)
    with PoolSet(args.device) as pools:
        for tokens in lengths:
            runs, kernel_peak = kernel_seconds(tokens, shape["heads"], shape["head_dim"], dtype, args.device)
            seconds = statistics.median(runs)
            for contract in ("usp.ulysses_parity", "usp.ulysses_grad"):
                if contract.endswith("grad") and args.grad_max and tokens > args.grad_max:
                    continue
                cost = contract_cost(pools, contract, tokens, shape, args.device)
                row = {"tokens": tokens, "kernel_s": seconds, "kernel_runs_s": runs, "kernel_peak_gib": kernel_peak}
                row["contract"] = contract
                rows.append({**row, **cost, "ratio": cost["seconds"] / seconds})
                peaks = cost["peak_gib_per_rank"]
                print(
                    f"{tokens} | {seconds:.4f} ({runs[0]:.4f}-{runs[-1]:.4f}) | {contract} | {cost['seconds']:.1f} | "
                    f"{cost['seconds'] / seconds:.0f} ({cost['seconds'] / runs[-1]:.0f}-{cost['seconds'] / runs[0]:.0f}) | "
                    f"{peaks.get('device', float('nan')):.1f} | {peaks.get('host', float('nan')):.2f} | "
                    f"{cost['status']}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": args.device, "shape": shape, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
