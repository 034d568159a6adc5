"""A calibration of the machine, measured in the rank next to the timings it normalises.

Absolute milliseconds of a small pipeline do not transfer between two machines of the same kind:
on two H200s the tiny pipeline's step took 3.2 ms and 5.0 ms with the same tree, because such a
pipeline is bound by the host's kernel launches, not by the GPU. So every timed case also
measures four fixed probes on the same device, in the same process, right before and after its
timed runs: the host-side cost of launching a tiny kernel (``launch_us``) and of calling a tiny
module (``module_us``: Python, the dispatcher and three launches, as a small model's layers
cost), a fixed matmul (``gemm_ms``) and a fixed attention kernel (``sdpa_ms``). Each probe is
the *fastest* of several repeats, the least disturbed reading: on an H200 the median of 200
launches moved by 35 % between two gates on one machine while the pipeline moved by 1 %. A baseline records the calibration of
the machine that produced it; a later run on another machine gates each value against
``expected × factor``, where ``factor`` is the largest ratio new/old over the probes: the machine
is allowed to be as much slower as its slowest axis is, and no more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

PROBES = ("launch_us", "module_us", "gemm_ms", "sdpa_ms")
_REPEATS = 9
_LAUNCHES = 2000


def _timed(fn: Callable[[], object], device: torch.device, inner: int) -> float:
    """Fastest wall time over the repeats of ``inner`` calls of ``fn`` (seconds per call), device work included."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    fn()
    sync(device)
    samples = []
    for _ in range(_REPEATS):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        samples.append((time.perf_counter() - start) / inner)
    return min(samples)


def measure(device: str) -> dict[str, float]:
    """The three probes on ``device`` (fixed sizes per device kind, seeded inputs)."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    on_gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tiny = torch.zeros(1, device=dev)
    n = 2048 if on_gpu else 256
    a, b = (torch.randn(n, n, generator=gen).to(dev, dtype) for _ in range(2))
    heads, seq, dim = (24, 1024, 64) if on_gpu else (4, 256, 32)
    q, k, v = (torch.randn(1, heads, seq, dim, generator=gen).to(dev, dtype) for _ in range(3))
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8)).to(dev)
    x = torch.zeros(1, 8, device=dev)
    with torch.inference_mode():
        return {
            "launch_us": _timed(lambda: tiny.add_(1.0), dev, _LAUNCHES) * 1e6,
            "module_us": _timed(lambda: module(x), dev, _LAUNCHES // 4) * 1e6,
            "gemm_ms": _timed(lambda: a @ b, dev, 20) * 1e3,
            "sdpa_ms": _timed(lambda: F.scaled_dot_product_attention(q, k, v), dev, 20) * 1e3,
        }


def combine(samples: list[Mapping[str, float]]) -> dict[str, float]:
    """Several calibrations of one run (before and after the timed runs) as one: the minimum per probe,
    the least disturbed reading."""
    return {probe: min(s[probe] for s in samples) for probe in PROBES}


def machine_factor(measured: Mapping[str, float], baseline: Mapping[str, float]) -> tuple[float, str]:
    """How much slower this machine is than the baseline's: the largest ratio over the probes both have."""
    ratios = {p: measured[p] / baseline[p] for p in PROBES if p in measured and p in baseline and baseline[p] > 0}
    if not ratios:
        raise ValueError(f"no common calibration probe (measured {sorted(measured)}, baseline {sorted(baseline)})")
    probe = max(ratios, key=lambda p: ratios[p])
    return ratios[probe], probe
