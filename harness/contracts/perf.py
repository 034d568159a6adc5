"""Perf contracts: ratios of two timings measured side by side in one run, on the same ranks.

A ratio survives a change of machine where absolute milliseconds do not: both sides run on the
same device, interleaved (A, B, A, B...), so clocks, host speed and load hit them alike. They run
in the gate's perf stage (``cases/perf/``), not with the parity contracts: a timing is a property
of a machine under load. ``perf.attention_overhead``: the target's rank-local attention against raw
``F.scaled_dot_product_attention`` on the same inputs; ``perf.sp_step_ratio``: the pipeline's
median denoising step under SP against the same pipeline on one rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from harness.contracts.judging import RankOutcome
from harness.contracts.params import NUMERIC, Param, ParamError, Params
from harness.contracts.pipeline import check_pipeline_dtype, pipeline_fields, pipeline_run_params
from harness.contracts.registry import Contract, RankContext, register
from harness.targets.base import Capability
from harness.targets.figures import StepRatio, reported


def _ratio_outcome(figures: dict[str, Any], limit: float, what: str) -> RankOutcome:
    ratio = figures["ratio"]
    figures["limit"] = limit
    problems = [] if ratio <= limit else [f"{what} is {ratio:.3g}× the baseline side, limit {limit:g}×"]
    return RankOutcome(problems=problems, checks=1, figures=figures)


def attention_overhead(ctx: RankContext, p: Params) -> RankOutcome:
    gen = torch.Generator().manual_seed(p.seed)
    q, k, v = (
        torch.randn(p.batch, p.tokens, p.heads, p.head_dim, generator=gen).to(ctx.device, p.torch_dtype)
        for _ in range(3)
    )
    attn = ctx.attention(p, skip_sequence_parallel=True)
    contiguous = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    env = {"attn": attn, "q": q, "k": k, "v": v, "F": F, "c": contiguous, "causal": p.causal}
    raw, layer = [], []
    for _ in range(p.repeats):  # interleaved, so drift hits both sides alike
        raw.append(
            Timer("F.scaled_dot_product_attention(*c, is_causal=causal)", globals=env)
            .blocked_autorange(min_run_time=p.min_run_time)
            .median
        )
        layer.append(Timer("attn(q, k, v)", globals=env).blocked_autorange(min_run_time=p.min_run_time).median)
    raw_ms, layer_ms = min(raw) * 1e3, min(layer) * 1e3
    figures = {"raw_sdpa_ms": raw_ms, "attention_ms": layer_ms, "ratio": layer_ms / raw_ms}
    outcome = _ratio_outcome(figures, 1.0 + p.max_overhead, "the target's attention")
    outcome.kernel = attn.kernel
    return outcome


def _positive(*keys: str):
    def check(p: Params) -> None:
        for key in keys:
            if not p[key] > 0:
                raise ParamError(key, f"must be positive, got {p[key]}")

    return check


register(
    Contract(
        "perf.attention_overhead",
        "the target's rank-local attention within max_overhead of raw torch SDPA on the same inputs (timed side by side)",
        (
            Param("world_size", "int", 1, "ranks (timed on each)"),
            Param("batch", "int", 1, "batch size B"),
            Param("tokens", "int", 1024, "sequence length S"),
            Param("heads", "int", 8, "heads H"),
            Param("kv_heads", "int", lambda p: p["heads"], "K/V heads"),
            Param("head_dim", "int", 64, "head dim D"),
            *NUMERIC,
            Param("max_overhead", "float", 0.05, "allowed extra time over raw SDPA (0.05 = 5 %)"),
            Param("repeats", "int", 3, "interleaved measurements of each side (the fastest counts)"),
            Param("min_run_time", "float", 0.3, "seconds per measurement"),
        ),
        attention_overhead,
        checks=(_positive("max_overhead", "repeats", "min_run_time", "tokens"),),
        timeout_s=300.0,
    )
)


def sp_step_ratio(ctx: RankContext, p: Params) -> RankOutcome:
    measured: StepRatio = ctx.target.model_check("perf.sp_step_ratio")(
        device=str(ctx.device), repeats=p.repeats, **pipeline_fields(p)
    )
    if ctx.rank != 0:  # every rank runs both layouts; rank 0's clock speaks for the group
        return RankOutcome(checks=1)
    return _ratio_outcome(reported(measured), p.max_ratio, f"the SP={p.world_size} denoising step")


register(
    Contract(
        "perf.sp_step_ratio",
        "the pipeline's median denoising step under SP = world_size within max_ratio of the same step on one rank",
        pipeline_run_params("fp32", 4)
        + (
            Param("max_ratio", "float", 3.0, "allowed SP step time over the one-rank step time"),
            Param("repeats", "int", 3, "interleaved runs of each layout"),
        ),
        sp_step_ratio,
        requires=frozenset({Capability.REFERENCE_MODELS}),
        checks=(check_pipeline_dtype, _positive("max_ratio", "repeats", "steps")),
        min_world_size=2,
        timeout_s=600.0,
    )
)
