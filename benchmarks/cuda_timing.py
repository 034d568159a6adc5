"""The benchmarks' one CUDA timer: the median of CUDA-event timings of a call, after warm-up calls."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_median_ms(call: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """The median ms of ``reps`` timed calls after ``warmup`` untimed ones (a kernel that compiles on its first
    call, as FA4 does, is timed warm)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
