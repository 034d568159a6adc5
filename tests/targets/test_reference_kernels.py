"""Kernel timing helpers: FLOP counts, every backend reported, unavailable ones with a reason."""

from __future__ import annotations

import torch

from harness.targets.reference.kernels import AttnShape, matmul_tflops, time_backends, usp_overhead

TINY = AttnShape(batch=1, seq=64, heads=2, head_dim=16)


def test_flops_formula():
    assert AttnShape(1, 10, 2, 8).flops() == 4 * 2 * 10 * 10 * 8
    assert AttnShape(1, 10, 2, 8, causal=True).flops() == 2 * 2 * 10 * 10 * 8


def test_every_backend_is_reported_with_time_or_reason():
    timings = {t.backend: t for t in time_backends(TINY, torch.float32, "cpu", min_run_time=0.01)}
    assert set(timings) == {"torch_sdpa", "fa", "sage_attn", "math"}
    timed = ("torch_sdpa", "math")
    assert {n: (timings[n].median_ms > 0, timings[n].tflops > 0, timings[n].skipped) for n in timed} == dict.fromkeys(
        timed, (True, True, None)
    )
    assert "flash-attn" in timings["fa"].skipped and timings["fa"].median_ms is None
    assert "sageattention" in timings["sage_attn"].skipped


def test_usp_overhead_and_matmul_report_positive_times():
    result = usp_overhead(TINY, torch.float32, "cpu", min_run_time=0.01)
    assert result["raw_sdpa_ms"] > 0 and result["usp_ms"] > 0 and result["raw_sdpa_same_layout_ms"] > 0
    assert matmul_tflops("cpu", torch.float32, n=64, min_run_time=0.01)["tflops"] > 0
