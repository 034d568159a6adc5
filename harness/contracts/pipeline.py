"""Pipeline-level contract: sglang's turbo-drift experiment on the tiny seeded pipeline (seed 001).

``pipeline.turbo_drift`` runs the few-step pipeline on one rank, under Ulysses SP with the caption
kept at the tail of the token order (``order_preserving``, the fix) and rotated to the front
(``rotate_to_front``, sglang's old layout). Judged: the order-preserving latents equal one rank's
bitwise. Reported, not bounded: the rotated layout's pixel and latent MAE (sglang measured 7.28 and
6.32 on Z-Image-Turbo; the tiny DiT is far less sensitive, so no number of sglang's bounds it). The
control (``control_drift``) only asks that the rotated latents move at all, so the experiment can
see a change of key order and the bitwise result means something.
"""

from __future__ import annotations

from harness.contracts.bounds import Bitwise
from harness.contracts.judging import OUTPUT, Against, Comparison, RankOutcome
from harness.contracts.params import LONG_DTYPE, Param, ParamError, Params, long_dtype_check
from harness.contracts.registry import Contract, RankContext, register
from harness.contracts.stats import compare
from harness.targets.base import Capability
from harness.targets.figures import TurboDrift, reported


def pipeline_run_params(dtype: str, steps: int) -> tuple[Param, ...]:
    """The parameters of a contract that runs the tiny pipeline: its ranks and the generation it asks for."""
    return (
        Param("world_size", "int", 2, "ranks (Ulysses degree = world_size)"),
        Param("dtype", "dtype", dtype, "fp32, bf16 or fp16"),
        Param("steps", "int", steps, "denoising steps"),
        Param("height", "int", 64, "image height (multiple of 8)"),
        Param("width", "int", 64, "image width (multiple of 8)"),
        Param("seed", "int", 0, "noise seed"),
        Param("prompt", "str", "a red fox in fresh snow", "the prompt"),
        Param("weights", "str", None, "a built-in checkpoint (tiny-v1) or .safetensors path; unset: random weights"),
    )


def pipeline_fields(p: Params) -> dict[str, object]:
    """What the target's pipeline is asked to generate, from a contract's :func:`pipeline_run_params`."""
    fields: dict[str, object] = {
        "prompt": p.prompt,
        "seed": p.seed,
        "height": p.height,
        "width": p.width,
        "steps": p.steps,
        "dtype": LONG_DTYPE[p.dtype],
    }
    if p.weights is not None:
        fields["weights"] = p.weights
    return fields


check_pipeline_dtype = long_dtype_check("the pipeline runs")


def _body(ctx: RankContext, p: Params) -> RankOutcome:
    import torch

    measured: TurboDrift = ctx.target.model_check("pipeline.turbo_drift")(device=str(ctx.device), **pipeline_fields(p))
    stats = compare(torch.from_numpy(measured.preserving_latents), torch.from_numpy(measured.single_latents))
    problems = []
    if p.control_drift and measured.figures.rotate_to_front_latent_mae == 0.0:
        problems.append(
            "control: rotate_to_front latents equal one rank's, so this case cannot tell key orders apart "
            "(change steps/size/dtype, or set control_drift = false)"
        )
    return RankOutcome(
        [Comparison(Against.REFERENCE, OUTPUT, stats)],
        problems=problems,
        checks=2 if p.control_drift else 1,
        kernel=measured.kernel,
        figures=reported(measured.figures),
    )


def _check(p: Params) -> None:
    """What the contract itself needs; whether the pipeline can run the size is the target's to check."""
    check_pipeline_dtype(p)
    for key in ("height", "width", "steps"):
        if p[key] < 1:
            raise ParamError(key, f"must be positive, got {p[key]}")


register(
    Contract(
        "pipeline.turbo_drift",
        "few-step pipeline under Ulysses SP: caption kept at the tail (order-preserving) equals one rank bitwise; "
        "caption rotated to the front (sglang's old layout) reported as pixel/latent MAE against one rank",
        pipeline_run_params("bf16", 9)  # sglang measured 9 and 30 steps
        + (Param("control_drift", "bool", True, "also require the rotated layout to move the latents (the control)"),),
        _body,
        requires=frozenset({Capability.REFERENCE_MODELS}),
        bound=lambda p: Bitwise(),
        checks=(_check,),
        min_world_size=2,
        timeout_s=300.0,
    )
)
