"""A calibration of the machine, measured in the ranks next to the timings it normalises.

Absolute milliseconds of a small pipeline do not transfer between two machines of the same kind:
on two H200s the tiny pipeline's step took 3.2 ms and 5.0 ms with the same tree, because such a
pipeline is bound by the host's kernel launches, not by the GPU; and on one H200 host the same
1-rank case took 35 to 61 ms across five gates of one hour as the host's own speed moved. So
every timed case also reads fixed probes on the same device, in the same processes, every rank
at once (every probe before the target is prepared and after the last timed run, ``step_ms``
also before each timed run): the host-side cost of launching a tiny kernel (``launch_us``) and of calling a tiny module
(``module_us``), a fixed matmul (``gemm_ms``), a fixed attention kernel (``sdpa_ms``), in a
group of several ranks a fixed all-to-all as the group's attention sends it (``comm_us``: staged
through the host where the group is gloo on a GPU), and ``step_ms``: parity's own synthetic DiT
step (tiny blocks, Ulysses' two all-to-alls per block in a group), work of the same kind as the
image cases' steps but none of the target's code. Each probe is the fastest of several repeats
(the least disturbed reading), the case's calibration the median of its readings.

A baseline records the calibration of the machine that produced it. A later run gates each value
against ``expected × factor``:

- ``factor`` is the ratio new/old of ``step_ms`` where both sides have it. Across five gates of
  one hour on one H200 host, the 2-rank cases' e2e over the step reading stayed within 1-7 %
  while ``module_us`` swung by 2x; a factor that weighted the separate probes by each scenario's
  profiled host/device/comm split (tried first) put an unchanged 2-rank case 46 % over its limit.
  On a second H200 three unchanged gates passed with step factors of 0.72 to 1.20 for the 1-rank
  case, while a 20 % slowdown of every denoising step failed all four cases. The step probe is
  bound by launches and exchanges as the built-in cases are; a GPU-bound pipeline (a real model
  at full size) moves with ``gemm_ms`` and ``sdpa_ms`` instead, which this rule does not follow;
- else (a baseline from before ``step_ms``) the largest ratio over the probes both sides have: the
  machine may be as much slower as its slowest axis is, and no more.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.baselines.perf import CALIBRATION_PROBES as PROBES
from harness.baselines.perf import STEP_PROBE

_REPEATS = 9
_LAUNCHES = 2000
_COMM_CALLS = 50
_COMM_ELEMENTS = 16384  # 64 KiB of fp32 per rank: the order of a tiny pipeline's Ulysses all-to-all
_STEP_SHAPE = {"tokens": 64, "dim": 64, "heads": 4, "blocks": 4}  # a tiny DiT's block, as the image cases' models are


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


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _exchange(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """An all-to-all over the default group as the group's attention sends it: on the GPU for NCCL;
    for gloo on a GPU staged through the host both ways, as ranks sharing one GPU send."""
    import torch.distributed as dist

    staged = device.type == "cuda" and dist.get_backend() != "nccl"

    def exchange(t: torch.Tensor) -> torch.Tensor:
        send = t.cpu() if staged else t
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send)
        return received.to(device) if staged else received

    return exchange


def _synthetic_step(device: torch.device, dtype: torch.dtype, world: int) -> Callable[[], torch.Tensor]:
    """A frozen stand-in for a small DiT's denoising step, parity's own code (no target's): per block a
    norm, a QKV projection, attention, an output projection and an MLP, with the two all-to-alls of
    Ulysses around the attention when the group has several ranks. Kernels this small leave the
    step bound by what bounds the image cases' steps: launches, Python, the group's exchanges."""
    tokens, dim, heads, blocks = (_STEP_SHAPE[k] for k in ("tokens", "dim", "heads", "blocks"))
    layers = [[torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim),
               torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)] for _ in range(blocks)]
    layers = [[m.to(device, dtype) for m in block] for block in layers]
    exchange = _exchange(device) if world > 1 else (lambda t: t)
    x = torch.zeros(tokens, dim, device=device, dtype=dtype)

    def step() -> torch.Tensor:
        h = x
        for norm, qkv, proj, up, down in layers:
            q, k, v = exchange(qkv(norm(h))).view(1, tokens, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(tokens, dim)
            h = h + proj(exchange(attended))
            h = h + down(F.gelu(up(norm(h))))
        return h

    return step


def _probe_setting(device: str) -> tuple[torch.device, torch.dtype, int]:
    dev = torch.device(device)
    return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32), _world()


def measure_step(device: str) -> dict[str, float]:
    """``step_ms`` alone: the reading taken between a case's timed runs (a few milliseconds of work)."""
    dev, dtype, world = _probe_setting(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.inference_mode():
        return {STEP_PROBE: _timed(_synthetic_step(dev, dtype, world), dev, 5) * 1e3}


def measure(device: str) -> dict[str, float]:
    """Every probe on ``device`` (fixed sizes per device kind), called by every rank of the group at
    once: the ranks of a scenario run side by side, sharing the host and, on one GPU, the device,
    so the probes are read under the same load. ``comm_us`` only in a group of several ranks.

    The global random state is left as it was: the probes run between a target's timed runs.
    """
    dev, dtype, world = _probe_setting(device)
    on_gpu = dev.type == "cuda"
    with torch.random.fork_rng(devices=[dev] if on_gpu else []), torch.inference_mode():
        gen = torch.Generator().manual_seed(0)
        tiny = torch.zeros(1, device=dev)
        n = 2048 if on_gpu else 256
        a, b = (torch.randn(n, n, generator=gen).to(dev, dtype) for _ in range(2))
        heads, seq, dim = (24, 1024, 64) if on_gpu else (4, 256, 32)
        q, k, v = (torch.randn(1, heads, seq, dim, generator=gen).to(dev, dtype) for _ in range(3))
        module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8)).to(dev)
        x = torch.zeros(1, 8, device=dev)
        probes = {
            "launch_us": _timed(lambda: tiny.add_(1.0), dev, _LAUNCHES) * 1e6,
            "module_us": _timed(lambda: module(x), dev, _LAUNCHES // 4) * 1e6,
            "gemm_ms": _timed(lambda: a @ b, dev, 20) * 1e3,
            "sdpa_ms": _timed(lambda: F.scaled_dot_product_attention(q, k, v), dev, 20) * 1e3,
        }
        if world > 1:
            payload = torch.ones(_COMM_ELEMENTS - _COMM_ELEMENTS % world, device=dev)
            exchange = _exchange(dev)
            probes["comm_us"] = _timed(lambda: exchange(payload), dev, _COMM_CALLS) * 1e6
    return {**probes, **measure_step(device)}


def combine(readings: list[Mapping[str, float]]) -> dict[str, float]:
    """The readings of one case as one calibration: the median per probe over the readings that have it.
    The host's own speed drifts between a case's runs and between gates (an H200 host's module
    probe read 36 to 82 µs across five gates of one hour), so the probes are read interleaved with
    the runs and the typical reading kept, as the runs' median is."""
    return {probe: float(statistics.median(r[probe] for r in readings if probe in r))
            for probe in PROBES if any(probe in r for r in readings)}


def run_scales(readings: list[Mapping[str, float]], runs: int) -> list[float] | None:
    """Per timed run, the factor that brings it to the case's typical machine speed: the case's
    ``step_ms`` (:func:`combine`) over the mean of the two readings around the run.

    ``readings`` as :func:`harness.gate.pipeline_runs` takes them: one before the target is
    prepared, one before each timed run, one after the last. On an H200 whose 1-rank case took
    37.9, 60.9 and 52.2 ms in three consecutive runs as the host's speed moved, the readings moved
    with it; scaling each run before the median took that case's worst gate of five from 27 % to
    12 % over its baseline. None when a reading lacks the step probe.
    """
    around = readings[1:]
    if len(around) != runs + 1 or any(STEP_PROBE not in r for r in readings):
        return None
    typical = combine(readings)[STEP_PROBE]
    return [typical / ((around[i][STEP_PROBE] + around[i + 1][STEP_PROBE]) / 2) for i in range(runs)]


@dataclass(frozen=True)
class MachineFactor:
    """How much slower this machine runs a scenario than the baseline's machine did, and why."""

    value: float
    how: str  # for the report: "step_ms: parity's synthetic step on this group", or "max over the probes: gemm_ms (...)"
    ratios: dict[str, float]  # new/old per probe both sides have


def _ratios(measured: Mapping[str, float], baseline: Mapping[str, float]) -> dict[str, float]:
    return {p: measured[p] / baseline[p] for p in PROBES if p in measured and p in baseline and baseline[p] > 0}


def machine_factor(measured: Mapping[str, float], baseline: Mapping[str, float]) -> MachineFactor:
    """The factor for the baseline's expected values (rules in the module docstring)."""
    ratios = _ratios(measured, baseline)
    if not ratios:
        raise ValueError(f"no common calibration probe (measured {sorted(measured)}, baseline {sorted(baseline)})")
    if STEP_PROBE in ratios:
        return MachineFactor(ratios[STEP_PROBE], f"{STEP_PROBE}: parity's synthetic step on this group", ratios)
    top = max(ratios, key=lambda p: ratios[p])
    return MachineFactor(ratios[top], f"max over the probes: {top} (the baseline has no {STEP_PROBE})", ratios)
