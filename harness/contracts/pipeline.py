"""Pipeline-level contract: sglang's turbo-drift experiment on the tiny seeded pipeline (seed 001).

``pipeline.turbo_drift`` runs the whole few-step pipeline three times on every rank: on one rank
(before sequence parallelism is set up, so it shares the rank's threads and kernels), under
Ulysses SP with the replicated caption kept at the tail of the attention's token order
(``order_preserving``, the fix) and with it rotated to the front (``rotate_to_front``, sglang's old
layout). Judged: the order-preserving latents equal the single-rank latents bitwise (so the image
does too). Reported, not bounded: the rotated layout's pixel and latent MAE against one rank,
which sglang measured as 7.28 (9 steps) and 6.32 (30 steps) on Z-Image-Turbo. The tiny random
DiT is far less sensitive than a trained 6B model, so its figures are much smaller and no
number of sglang's can bound them; what is checked of the rotated run (``control_drift``) is only
that its latents differ from one rank at all, which shows the experiment can see a change of key
order and so that the bitwise result of the order-preserving path means something.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.contracts.bounds import Bitwise
from harness.contracts.params import Param, ParamError, Params
from harness.contracts.registry import Contract, RankContext, register
from harness.contracts.verdict import RankOutcome, compare

_LONG_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _mae(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


@dataclass(frozen=True)
class DriftRuns:
    """The three runs of one config on this rank (PipelineResults)."""

    single: Any
    preserving: Any
    rotated: Any


def drift_runs(config: Any) -> DriftRuns:
    """On every rank of a group: ``config`` on one rank, then under SP (degree = world size) in both layouts."""
    from reference_impl.pipeline import run_pipeline, run_pipeline_sequence_parallel

    preserving_config = dataclasses.replace(config, suffix_mode="order_preserving")
    return DriftRuns(
        run_pipeline(preserving_config),  # SP not set up yet: this rank alone, same threads and kernels
        run_pipeline_sequence_parallel(preserving_config),
        run_pipeline_sequence_parallel(dataclasses.replace(config, suffix_mode="rotate_to_front")),
    )


def drift_figures(runs: DriftRuns) -> dict[str, Any]:
    """Pixel MAE (0..255 units) and latent MAE of each SP layout against one rank."""
    single, preserving, rotated = runs.single, runs.preserving, runs.rotated
    return {
        "order_preserving_bitwise": bool(np.array_equal(preserving.latents, single.latents)
                                         and np.array_equal(preserving.output, single.output)),
        "order_preserving_mae": _mae(preserving.output, single.output),
        "rotate_to_front_mae": _mae(rotated.output, single.output),
        "rotate_to_front_max_abs": float(np.abs(rotated.output.astype(np.int16) - single.output.astype(np.int16)).max()),
        "rotate_to_front_latent_mae": _mae(rotated.latents, single.latents),
    }


def turbo_drift(config: Any) -> dict[str, Any]:
    """Rank worker: :func:`drift_figures` of :func:`drift_runs` (module level, so a pool can pickle it)."""
    return drift_figures(drift_runs(config))


def _body(ctx: RankContext, p: Params) -> RankOutcome:
    import torch

    from reference_impl.pipeline import PipelineConfig

    config = PipelineConfig(prompt=p.prompt, seed=p.seed, height=p.height, width=p.width, steps=p.steps,
                            dtype=_LONG_DTYPE[p.dtype], device=str(ctx.device))
    runs = drift_runs(config)
    figures = drift_figures(runs)
    stats = compare(torch.from_numpy(runs.preserving.latents), torch.from_numpy(runs.single.latents))
    problems = []
    if p.control_drift and figures["rotate_to_front_latent_mae"] == 0.0:
        problems.append("control: rotate_to_front latents equal one rank's, so this case cannot tell key orders apart "
                        "(change steps/size/dtype, or set control_drift = false)")
    return RankOutcome(stats=stats, problems=problems, checks=2 if p.control_drift else 1,
                       kernel=runs.preserving.backends["dit"], extra=figures)


def _check(p: Params) -> None:
    if p.dtype not in _LONG_DTYPE:
        raise ParamError("dtype", f"the pipeline runs in {', '.join(_LONG_DTYPE)}, not {p.dtype}")
    from reference_impl.models.layers import ModelConfigError
    from reference_impl.pipeline import PIXELS_PER_DIT_TOKEN, PipelineConfig

    try:
        PipelineConfig(height=p.height, width=p.width, steps=p.steps)
    except ModelConfigError as exc:
        raise ParamError(exc.key or "height", exc.args[0]) from None
    tokens = (p.height // PIXELS_PER_DIT_TOKEN) * (p.width // PIXELS_PER_DIT_TOKEN)
    if tokens % p.world_size:
        raise ParamError("world_size", f"{tokens} image tokens ({p.height}x{p.width}) do not divide by world_size {p.world_size}")


register(Contract(
    "pipeline.turbo_drift",
    "few-step pipeline under Ulysses SP: caption kept at the tail (order-preserving) equals one rank bitwise; "
    "caption rotated to the front (sglang's old layout) reported as pixel/latent MAE against one rank",
    (
        Param("world_size", "int", 2, "ranks (Ulysses degree = world_size)"),
        Param("dtype", "dtype", "bf16", "fp32, bf16 or fp16"),
        Param("steps", "int", 9, "denoising steps (sglang: 9 and 30)"),
        Param("height", "int", 64, "image height (multiple of 8)"),
        Param("width", "int", 64, "image width (multiple of 8)"),
        Param("seed", "int", 0, "noise seed"),
        Param("prompt", "str", "a red fox in fresh snow", "the prompt"),
        Param("control_drift", "bool", True, "also require the rotated layout to move the latents (the control)"),
    ),
    _body,
    requires=frozenset({"reference_models"}),
    bound=lambda p: Bitwise(),
    checks=(_check,),
    min_world_size=2,
    timeout_s=300.0,
))
