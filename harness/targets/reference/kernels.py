"""Kernel timings for sweeps: each backend's time and achieved TFLOP/s on a standard shape,
the reference USPAttention's overhead over the raw kernel, and the device's matmul rate.

Timings use ``torch.utils.benchmark.Timer`` (it synchronizes CUDA and reports a median over
adaptive repeats), so CPU and GPU figures come from one well-tested timer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from reference_impl import USPAttention, set_forward_context
from reference_impl.attention.backends import BACKENDS, AttentionBackendEnum, TorchSDPABackend


@dataclass(frozen=True)
class AttnShape:
    batch: int = 1
    seq: int = 4096 + 512
    heads: int = 24
    head_dim: int = 128
    causal: bool = False

    def flops(self) -> float:
        """Forward FLOPs: two matmuls of 2·B·H·S²·D each, halved when causal."""
        total = 4.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim
        return total / 2 if self.causal else total

    def label(self) -> str:
        return f"B={self.batch} S={self.seq} H={self.heads} D={self.head_dim}{' causal' if self.causal else ''}"


STANDARD_SHAPE = AttnShape()


@dataclass(frozen=True)
class KernelTiming:
    backend: str
    kernel: str | None
    dtype: str
    shape: str
    median_ms: float | None
    tflops: float | None
    skipped: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _median_ms(stmt: str, env: dict, min_run_time: float) -> float:
    measurement = Timer(stmt=stmt, globals=env).blocked_autorange(min_run_time=min_run_time)
    return measurement.median * 1e3


def _inputs(shape: AttnShape, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(shape.batch, shape.seq, shape.heads, shape.head_dim, generator=gen).to(device, dtype)
        for _ in range(3)
    )


def time_backends(
    shape: AttnShape = STANDARD_SHAPE,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    min_run_time: float = 0.5,
) -> list[KernelTiming]:
    """Every backend (and, on CUDA, every pinned SDPA kernel) on one shape; unavailable ones say why."""
    q, k, v = _inputs(shape, dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    candidates: list[tuple[AttentionBackendEnum, str | None]] = [(e, None) for e in BACKENDS]
    if device.startswith("cuda"):
        candidates += [(AttentionBackendEnum.TORCH_SDPA, k) for k in ("flash", "efficient", "cudnn", "math")]
    timings = []
    for enum, kernel in candidates:
        cls = BACKENDS[enum]
        reason = cls.unavailable_reason() or (None if cls.supports_dtype(dtype) else f"does not support {dtype_name}")
        if reason:
            timings.append(KernelTiming(enum.value, kernel, dtype_name, shape.label(), None, None, reason))
            continue
        backend = TorchSDPABackend(kernel=kernel) if kernel else cls()
        env = {"b": backend, "q": q, "k": k, "v": v, "c": shape.causal}
        try:
            ms = _median_ms("b.forward(q, k, v, causal=c)", env, min_run_time)
        except RuntimeError as exc:
            timings.append(
                KernelTiming(enum.value, kernel, dtype_name, shape.label(), None, None, str(exc).splitlines()[0][:200])
            )
            continue
        timings.append(
            KernelTiming(enum.value, kernel, dtype_name, shape.label(), ms, shape.flops() / (ms * 1e-3) / 1e12)
        )
    return timings


def usp_overhead(
    shape: AttnShape = STANDARD_SHAPE,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    min_run_time: float = 1.0,
) -> dict:
    """USPAttention's single-rank path against the raw SDPA call it wraps, timed side by side."""
    q, k, v = _inputs(shape, dtype, device)
    # The raw kernel gets the [B, H, S, D] layout it prefers (contiguous); USPAttention gets the
    # [B, S, H, D] layout models hold, and "raw, same layout" isolates the layer's own cost.
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    qv, kv, vv = (t.transpose(1, 2) for t in (q, k, v))
    with set_forward_context():
        attn = USPAttention(shape.heads, shape.head_dim, causal=shape.causal, backend="torch_sdpa")
        env = {"F": F, "attn": attn, "q": q, "k": k, "v": v, "c": shape.causal}
        env.update(qt=qt, kt=kt, vt=vt, qv=qv, kv=kv, vv=vv)
        # Interleave the measurements twice so drift (clocks, caches) hits all of them alike.
        raw, same, usp = [], [], []
        for _ in range(2):
            raw.append(_median_ms("F.scaled_dot_product_attention(qt, kt, vt, is_causal=c)", env, min_run_time))
            same.append(
                _median_ms("F.scaled_dot_product_attention(qv, kv, vv, is_causal=c).transpose(1, 2)", env, min_run_time)
            )
            usp.append(_median_ms("attn(q, k, v)", env, min_run_time))
    raw_ms, same_ms, usp_ms = min(raw), min(same), min(usp)
    return {
        "shape": shape.label(),
        "dtype": str(dtype).removeprefix("torch."),
        "raw_sdpa_ms": raw_ms,
        "raw_sdpa_same_layout_ms": same_ms,
        "usp_ms": usp_ms,
        "overhead_pct": 100.0 * (usp_ms - raw_ms) / raw_ms,
        "layer_overhead_pct": 100.0 * (usp_ms - same_ms) / same_ms,
        "usp_tflops": shape.flops() / (usp_ms * 1e-3) / 1e12,
    }


def matmul_tflops(
    device: str = "cpu", dtype: torch.dtype = torch.bfloat16, n: int | None = None, min_run_time: float = 1.0
) -> dict:
    """The device's measured dense matmul rate: the yardstick for attention TFLOP/s."""
    n = n or (8192 if device.startswith("cuda") else 1024)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device, dtype) for _ in range(2))
    ms = _median_ms("a @ b", {"a": a, "b": b}, min_run_time)
    return {
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "median_ms": ms,
        "tflops": 2.0 * n**3 / (ms * 1e-3) / 1e12,
    }
