"""The reference pipeline target (``reference_impl.pipeline``) and the turbo-drift measurement on it.

An image case's fields are :class:`~reference_impl.pipeline.PipelineConfig` fields (``prompt``,
``seed``, ``height``, ``width``, ``steps``, ``num_frames``, ``dtype``, ``suffix_mode``, ...);
``device`` is set per rank. :meth:`ReferencePipelineTarget.prepare` sets up Ulysses SP over the
whole group and builds the models once, so the perf stage can time N runs of one setup the way
a server runs them (NCCL creates a communicator lazily at a group's first collective: timing
run by run would time that inside the first denoising step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch.distributed as dist

from harness.errors import ParamError
from harness.targets.base import PipelineOutput, PipelineTarget, Timings
from harness.targets.figures import DriftFigures, StepRatio, TurboDrift
from reference_impl.models.layers import ModelConfigError
from reference_impl.parallel.state import destroy_sequence_parallel, init_sequence_parallel
from reference_impl.pipeline import (
    PIXELS_PER_DIT_TOKEN,
    PipelineConfig,
    PipelineModels,
    PipelineResult,
    build_models,
    run_pipeline,
    run_pipeline_sequence_parallel,
)

#: The pipeline's stage names -> sglang's stage names (``is_denoise_stage`` knows the denoising one).
STAGE_NAMES = {"text_encoding": "TextEncodingStage", "denoising": "DenoisingStage", "decoding": "DecodingStage"}
_RUNNER_KEYS = ("device",)  # set per rank, never by a case
#: The largest run a case may ask of the tiny pipeline: DiT image tokens of one generation (a
#: 2048x2048 image, or 64x64 x 1024 frames), denoising steps, text tokens. Beyond them a case is a
#: typo that would allocate or loop until the rank is killed.
MAX_IMAGE_TOKENS = 2**16
MAX_STEPS = 1000
MAX_TEXT_TOKENS = 4096


def pipeline_config(fields: Mapping[str, Any], device: str = "cpu") -> PipelineConfig:
    """The config an image case's fields describe; ParamError naming the key when they are wrong."""
    for key in _RUNNER_KEYS:
        if key in fields:
            raise ParamError(key, "set by the runner (--device), not by a case")
    try:
        return PipelineConfig.from_dict({**fields, "device": device})
    except ModelConfigError as exc:
        raise ParamError(exc.key or "", exc.args[0].split(": ", 1)[-1]) from None


def image_tokens(config: PipelineConfig) -> int:
    """DiT image tokens of one generation (all frames): what SP shards."""
    per_frame = (config.height // PIXELS_PER_DIT_TOKEN) * (config.width // PIXELS_PER_DIT_TOKEN)
    return per_frame * (config.num_frames or 1)


def timings_of(result: PipelineResult) -> Timings:
    t = result.timings
    return Timings(t.e2e_ms, {STAGE_NAMES[k]: v for k, v in t.stages_ms.items()}, list(t.denoise_step_ms), t.clock)


class _Prepared:
    """Models built once, SP over the whole group set up once; ``run()`` generates."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        init_sequence_parallel(dist.get_world_size(), 1)
        try:
            self.models: PipelineModels = build_models(config)
        except BaseException:
            destroy_sequence_parallel()
            raise

    def run(self) -> PipelineOutput:
        result = run_pipeline(self.config, self.models)
        return PipelineOutput(result.output, timings_of(result), result.backends, result.nonfinite)

    def close(self) -> None:
        destroy_sequence_parallel()


class ReferencePipelineTarget(PipelineTarget):
    name = "reference"

    def check_case(self, fields: Mapping[str, Any], world_size: int) -> str:
        config = pipeline_config(fields)
        tokens = image_tokens(config)
        if tokens > MAX_IMAGE_TOKENS:
            key = "height" if config.height >= config.width else "width"
            key = "num_frames" if tokens // (config.num_frames or 1) <= MAX_IMAGE_TOKENS else key
            raise ParamError(
                key,
                f"{config.height}x{config.width}"
                + (f"x{config.num_frames} frames" if config.num_frames else "")
                + f" makes {tokens} image tokens; at most {MAX_IMAGE_TOKENS}",
            )
        for key, limit in (("steps", MAX_STEPS), ("max_text_tokens", MAX_TEXT_TOKENS)):
            if getattr(config, key) > limit:
                raise ParamError(key, f"{getattr(config, key)} is above the maximum {limit}")
        if tokens % world_size:
            frames = f"x{config.num_frames} frames" if config.num_frames else ""
            raise ParamError(
                "world_size",
                f"{tokens} image tokens ({config.height}x{config.width}{frames}) "
                f"do not divide by world_size {world_size}",
            )
        return "image" if config.num_frames is None else "video"

    def output_shape(self, fields: Mapping[str, Any]) -> tuple[int, ...]:
        config = pipeline_config(fields)
        return (*((config.num_frames,) if config.num_frames else ()), config.height, config.width, 3)

    def prepare(self, fields: Mapping[str, Any], device: str, world_size: int | None = None) -> _Prepared:
        return _Prepared(pipeline_config(fields, device))  # runs in ranks: the group is the world


def factory() -> ReferencePipelineTarget:
    return ReferencePipelineTarget()


# ------------------------------------------------------------------------ turbo drift


def _mae(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def turbo_drift(device: str, **fields: Any) -> TurboDrift:
    """On every rank of a group: the config on one rank, then under SP (degree = world size) in both
    caption layouts (order-preserving and rotated to the front): the figures, the single-rank and
    order-preserving latents (for the contract's bitwise comparison in this rank) and the DiT backend."""
    config = dataclasses.replace(pipeline_config(fields, device), suffix_mode="order_preserving")
    single = run_pipeline(config)  # SP not set up yet: this rank alone, same threads and kernels
    preserving = run_pipeline_sequence_parallel(config)
    rotated = run_pipeline_sequence_parallel(dataclasses.replace(config, suffix_mode="rotate_to_front"))
    figures = DriftFigures(
        order_preserving_bitwise=bool(
            np.array_equal(preserving.latents, single.latents) and np.array_equal(preserving.output, single.output)
        ),
        order_preserving_mae=_mae(preserving.output, single.output),
        rotate_to_front_mae=_mae(rotated.output, single.output),
        rotate_to_front_max_abs=float(np.abs(rotated.output.astype(np.int16) - single.output.astype(np.int16)).max()),
        rotate_to_front_latent_mae=_mae(rotated.latents, single.latents),
    )
    return TurboDrift(figures, single.latents, preserving.latents, preserving.backends["dit"])


def check_pipeline_case(params: Mapping[str, Any]) -> None:
    """Parameters of a contract that runs the pipeline (``pipeline.turbo_drift``, ``perf.sp_step_ratio``)
    that the pipeline can run (ParamError naming the key), before any rank starts."""
    fields = {
        k: params[k] for k in ("prompt", "seed", "height", "width", "steps", "weights") if params.get(k) is not None
    }
    ReferencePipelineTarget().check_case(fields, int(params.get("world_size", 1)))


def sp_step_ratio(device: str, repeats: int = 3, **fields: Any) -> StepRatio:
    """On every rank of a group: the median denoising step of ``fields`` on one rank and under SP over
    the group, timed side by side (A, B, A, B...) on the same ranks, models built once per layout."""
    import statistics

    config = pipeline_config(fields, device)
    single_models = build_models(config)  # SP not set up yet: a one-rank pipeline
    single_steps: list[float] = []
    sp_steps: list[float] = []
    run_pipeline(config, single_models)  # warm-up
    prepared = _Prepared(config)
    try:
        prepared.run()  # warm-up under SP (pays the communicators' first collective)
        for _ in range(repeats):
            destroy_sequence_parallel()
            single_steps += run_pipeline(config, single_models).timings.denoise_step_ms
            init_sequence_parallel(dist.get_world_size(), 1)
            sp_steps += prepared.run().timings.denoise_step_ms
    finally:
        prepared.close()
    single, sp = statistics.median(single_steps), statistics.median(sp_steps)
    return StepRatio(single, sp, sp / single, len(sp_steps))
