"""A calibration of the machine, measured in the ranks next to the timings it normalises.

Absolute milliseconds of a small pipeline do not transfer between two machines of the same kind:
on two H200s the tiny pipeline's step took 3.2 ms and 5.0 ms with the same tree, because such a
pipeline is bound by the host's kernel launches, not by the GPU. So every timed case also
measures fixed probes on the same device, in the same processes, before the target is prepared
and again after its timed runs: the host-side cost of launching a tiny kernel (``launch_us``) and
of calling a tiny module (``module_us``: Python, the dispatcher and three launches, as a small
model's layers cost), a fixed matmul (``gemm_ms``), a fixed attention kernel (``sdpa_ms``) and,
in a group of several ranks, a fixed all-to-all as the group's attention sends it (``comm_us``:
staged through the host where the group is gloo on a GPU). Each probe is the *fastest* of several
repeats, the least disturbed reading: on an H200 the median of 200 launches moved by 35 % between
two gates on one machine while the pipeline moved by 1 %.

A baseline records the calibration of the machine that produced it and, where the run could be
profiled, the scenario's :mod:`time shares <harness.gate.time_shares>` (how much of its time was
host work, waiting on the device, communication). A later run on another machine gates each value
against ``expected × factor``:

- with time shares, ``factor = Σ share × ratio`` over the three parts, each part's ratio new/old
  of its probe (:data:`PART_PROBES`): a machine whose host is 35 % faster and whose GPU is as fast
  speeds a host-bound scenario up by about 35 %, and the gate expects that. The largest ratio
  alone would have let a 15 % slowdown through there (measured on an H200 whose host was faster);
- without them (a command target, an old baseline), the largest ratio over the probes both sides
  have: the machine may be as much slower as its slowest axis is, and no more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.baselines.perf import COMM, DEVICE, HOST, SHARE_PARTS

PROBES = ("launch_us", "module_us", "gemm_ms", "sdpa_ms", "comm_us")
_REPEATS = 9
_LAUNCHES = 2000
_COMM_CALLS = 50
_COMM_ELEMENTS = 16384  # 64 KiB of fp32 per rank: the order of a tiny pipeline's Ulysses all-to-all

# Which probes a part of a scenario's time moves with. On a GPU the host's part is the Python and
# launch overhead (module_us followed the 1-rank tiny pipeline to 1 % on a faster host, launch_us
# did not); on a CPU the host also does the arithmetic.
PART_PROBES: dict[str, dict[str, tuple[str, ...]]] = {
    "cuda": {HOST: ("module_us",), DEVICE: ("gemm_ms", "sdpa_ms"), COMM: ("comm_us",)},
    "cpu": {HOST: ("module_us", "gemm_ms", "sdpa_ms"), DEVICE: ("gemm_ms", "sdpa_ms"), COMM: ("comm_us",)},
}


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
    """The single-process probes on ``device`` (fixed sizes per device kind, seeded inputs)."""
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


def measure_comm(device: str) -> float:
    """``comm_us``: one all-to-all of a fixed tensor over the default process group, every rank calling it.

    The tensor lives where the group's backend takes it: on the GPU for NCCL; for gloo on a GPU it
    is staged through the host both ways, as ranks sharing one GPU send their attention.
    """
    import torch.distributed as dist

    dev = torch.device(device)
    world = dist.get_world_size()
    staged = dev.type == "cuda" and dist.get_backend() != "nccl"
    x = torch.ones(_COMM_ELEMENTS - _COMM_ELEMENTS % world, device=dev)

    def once() -> None:
        send = x.cpu() if staged else x
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send)
        if staged:
            received.to(dev)

    with torch.inference_mode():
        return _timed(once, dev, _COMM_CALLS) * 1e6


def combine(samples: list[Mapping[str, float]]) -> dict[str, float]:
    """Several calibrations of one run (before and after the timed runs) as one: the minimum per probe
    that every sample has, the least disturbed reading."""
    common = [p for p in PROBES if all(p in s for s in samples)]
    return {probe: min(s[probe] for s in samples) for probe in common}


@dataclass(frozen=True)
class MachineFactor:
    """How much slower this machine runs a scenario than the baseline's machine did, and why."""

    value: float
    how: str  # for the report: "host 62% × 0.65 + comm 35% × 0.97 + device 3% × 1.00", or "max over the probes: gemm_ms"
    ratios: dict[str, float]  # new/old per probe both sides have


def _ratios(measured: Mapping[str, float], baseline: Mapping[str, float]) -> dict[str, float]:
    return {p: measured[p] / baseline[p] for p in PROBES if p in measured and p in baseline and baseline[p] > 0}


def machine_factor(measured: Mapping[str, float], baseline: Mapping[str, float],
                   shares: Mapping[str, float] | None = None, device_type: str = "cuda") -> MachineFactor:
    """The factor for the baseline's expected values (rules in the module docstring).

    Shares that need a probe one side lacks (a baseline from before ``comm_us``) fall back to the
    largest ratio, and ``how`` says so.
    """
    ratios = _ratios(measured, baseline)
    if not ratios:
        raise ValueError(f"no common calibration probe (measured {sorted(measured)}, baseline {sorted(baseline)})")
    top = max(ratios, key=lambda p: ratios[p])
    fallback = MachineFactor(ratios[top], f"max over the probes: {top}", ratios)
    if not shares:
        return fallback
    probes = PART_PROBES["cuda" if device_type == "cuda" else "cpu"]
    total = sum(shares.get(part, 0.0) for part in SHARE_PARTS)
    terms: list[tuple[str, float, float]] = []
    for part in SHARE_PARTS:
        share = shares.get(part, 0.0) / total if total > 0 else 0.0
        if share == 0.0:
            continue
        have = [ratios[p] for p in probes[part] if p in ratios]
        if not have:
            missing = "/".join(probes[part])
            return MachineFactor(fallback.value, f"{fallback.how} (the {part} share needs {missing}, which one side lacks)", ratios)
        terms.append((part, share, max(have)))
    value = sum(share * ratio for _, share, ratio in terms)
    how = " + ".join(f"{part} {share:.0%} × {ratio:.3g}" for part, share, ratio in terms)
    return MachineFactor(value, how, ratios)
