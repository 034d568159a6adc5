"""What a rank group costs: its start (spawned versus preloaded, per world size) and a small case's call in it.

Per world size, a group's start spawned versus forked from the preloaded server: the time until every rank has
joined the process group and answered ready. The preloaded server's own start (one interpreter importing torch
and the harness, once per process) is shown apart: the first preloaded group's start minus a warm one's. Then a
small 2-rank case in a fresh group per case (run_on_ranks) versus a persistent RankPool, and why ranks default to
one intra-op thread: the same compute-bound case in a pool whose ranks use 1 thread versus 2 (OMP_NUM_THREADS=2),
2 ranks either way.

    .venv/bin/python benchmarks/launcher.py [--starts 3] [--worlds 1 2 4] [--calls 20] [--fresh 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harness.ranks import RankPool, rank_device, run_on_ranks
from harness.ranks.starting import PRELOADED, SPAWN, preloaded_modules

SHAPE = (1, 64, 8, 64)  # [B, S_local, H, D]: one rank's shard of a small attention input


def all_to_all_case() -> float:
    """One all_to_all_single of a [1,64,8,64] shard, checked exactly against the known inputs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = torch.Size(SHAPE).numel()

    def shard(src: int) -> torch.Tensor:
        return torch.arange(numel, dtype=torch.float32).reshape(SHAPE) + 1e6 * src

    send = shard(rank).to(rank_device()).flatten()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send)
    chunk = numel // world
    expected = torch.cat([shard(src).flatten()[rank * chunk : (rank + 1) * chunk] for src in range(world)])
    return float((received.cpu() - expected).abs().max())


def compute_case() -> float:
    """Compute-bound work per rank (matmuls), to see the cost of oversubscribing the cores."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    a = torch.randn(384, 384, generator=gen)
    for _ in range(20):
        a = torch.tanh(a @ a)
    return float(a.sum())


def _timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _start_s(world: int, method: str) -> float:
    """Seconds until a fresh group of ``world`` ranks started by ``method`` is ready (then closed, untimed)."""
    start = time.perf_counter()
    pool = RankPool(world, start_method=method)
    ready = time.perf_counter() - start
    pool.close()
    return ready


def print_start_costs(worlds: list[int], starts: int) -> None:
    """Group start, spawn vs preloaded, side by side per world size (medians of ``starts``)."""
    first = _start_s(worlds[0], PRELOADED)  # pays the server's own start, unless it already runs
    rows = []
    for world in worlds:  # alternated, so a change of the machine's load falls on both methods alike
        pairs = [(_start_s(world, SPAWN), _start_s(world, PRELOADED)) for _ in range(starts)]
        rows.append((world, statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)))
    print(
        f"group start until every rank is ready, median of {starts} (the server preloads {', '.join(preloaded_modules())}):"
    )
    print(f"  {'W':>2}  {'spawn':>9}  {'preloaded':>9}  {'spawn/preloaded':>15}")
    for world, spawned, preloaded in rows:
        print(f"  {world:>2}  {spawned:8.2f}s  {preloaded:8.2f}s  {spawned / preloaded:14.1f}x")
    print(f"preloaded server's own start (once per process): {first - rows[0][2]:.2f} s")


def _pool_median(pool: RankPool, fn: Callable[[], Any], calls: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        pool.run(fn)
    return statistics.median(_timed(lambda: pool.run(fn)) for _ in range(calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="timed pool calls (after 3 warm-up calls)")
    parser.add_argument("--fresh", type=int, default=3, help="fresh run_on_ranks groups to time")
    parser.add_argument("--starts", type=int, default=3, help="group starts to time per world size and start method")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes of the start-up table")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"torch {torch.__version__}, {cores} usable cores, gloo, cpu, load average {os.getloadavg()[0]:.1f}")
    print_start_costs(args.worlds, args.starts)
    print(f"\ncase: all_to_all_single of a {list(SHAPE)} shard + exact check, 2 ranks, preloaded")

    fresh = [
        _timed(lambda: run_on_ranks(all_to_all_case, world_size=2, start_method=PRELOADED)) for _ in range(args.fresh)
    ]
    with RankPool(2, start_method=PRELOADED) as pool:
        assert pool.run(all_to_all_case) == [0.0, 0.0]
        pooled = _pool_median(pool, all_to_all_case, args.calls)
    fresh_ms, pooled_ms = statistics.median(fresh) * 1e3, pooled * 1e3
    print(f"fresh group per case (run_on_ranks), median of {args.fresh}: {fresh_ms:9.1f} ms")
    print(f"pool marginal cost per case, median of {args.calls}: {pooled_ms:9.2f} ms")
    print(f"ratio fresh / pool                         : {fresh_ms / pooled_ms:9.0f}x")
    print(f"target pool < 50 ms per small case         : {'met' if pooled_ms < 50 else 'NOT met'}")

    user_threads = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        with RankPool(2) as pool:  # ranks default to 1 thread
            one = _pool_median(pool, compute_case, args.calls // 2)
        os.environ["OMP_NUM_THREADS"] = (
            "2"  # handed to the ranks with the rest of the environment; the launcher then leaves it
        )
        with RankPool(2) as pool:
            two = _pool_median(pool, compute_case, args.calls // 2)
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if user_threads is not None:
            os.environ["OMP_NUM_THREADS"] = user_threads
    print(f"compute case, 2 ranks x 1 thread (default)  : {one * 1e3:9.1f} ms")
    print(f"compute case, 2 ranks x 2 threads            : {two * 1e3:9.1f} ms  ({two / one:.2f}x)")


if __name__ == "__main__":
    main()
