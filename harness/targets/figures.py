"""What a target's model checks measure (:meth:`Target.model_check`), as typed figures; never a verdict.

The model-level contracts (``model.*``, ``encoder.*``, ``vae.*``, ``pipeline.*``, ``perf.sp_step_ratio``)
judge these in :mod:`harness.contracts`; a check only measures, so a bound or an expectation lives in
one place, next to the verdict it makes. :func:`reported` is how a figure reaches a result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def reported(figures: Any) -> dict[str, Any]:
    """A figures dataclass as the result's figures: every field, nested ones as dicts, unmeasured (None) ones left out."""
    return {k: v for k, v in dataclasses.asdict(figures).items() if v is not None}


@dataclass(frozen=True)
class PathFigures:
    """One model path under SP against the same path on one rank (and both against a float64 run)."""

    bitwise: bool
    finite: bool
    max_abs: float
    mean_abs: float
    max_abs_vs_fp64: float  # the SP output against the float64 single-rank run
    single_rank_max_abs_vs_fp64: float  # the low precision single-rank run against it
    numel: int
    where: dict[str, Any] | None = None  # where the difference sits (harness.targets.reference.locate)


@dataclass(frozen=True)
class ModelParity:
    """A model's SP paths on one rank (gathered: every rank holds the same figures) and which kernel ran."""

    paths: dict[str, PathFigures]
    backend: str
    backend_level: str  # the selector's precedence level that chose it
    sdpa_kernel: str | None
    rank: int
    world_size: int
    setup: dict[str, Any] = field(default_factory=dict)  # what ran (model, dtype, seed, lengths): reported only

    @property
    def kernel(self) -> str:
        pinned = f"[{self.sdpa_kernel}]" if self.sdpa_kernel else ""
        return f"{self.backend}{pinned} ({self.backend_level})"


@dataclass(frozen=True)
class MaskedCausal:
    """The encoder's masked causal attention against an fp64 per-row reference."""

    backend_masked: str
    backend_causal: str
    max_abs: float  # the given lengths
    max_abs_full: float  # an all-full batch
    finite: bool
    zero_rows_exactly_zero: bool
    full_batch_plain_causal: bool  # an all-full batch takes the plain causal path (no mask)


@dataclass(frozen=True)
class Rejection:
    """One checkpoint the loader must refuse, and how many tensors it read before refusing."""

    rejected: bool
    tensors_read: int
    names_class: bool | None = None  # the refusal names the encoder class / the component (None: not refused)
    names_component: bool | None = None
    message: str | None = None


@dataclass(frozen=True)
class Admission:
    checkpoint_tensors: int
    admitted_tensors_read: int
    quantized_layers: int
    processed_layers: int
    expected_quantized_layers: int  # the linears the built encoder holds (4 per layer: qkv, o, gate_up, down)
    rejections: dict[str, Rejection]


@dataclass(frozen=True)
class PackedQkv:
    bit_exact: bool  # every shard's weight and weight_scale_inv bit for bit in its place of the fused parameter
    distinct_shard_scales: bool  # the shards' scales differ, so a misplaced one would show
    layout: str


@dataclass(frozen=True)
class Fp8Parity:
    layout: str
    bitwise_vs_dequantized_bf16: bool
    max_abs_vs_bf16: float
    rel_l2_vs_bf16: float
    ref_max_abs: float
    scaled_mm_kernels: list[str] | None = None  # per tensor only: the scaled_mm path's kernels and error
    rel_l2_scaled_mm_vs_bf16: float | None = None
    scaled_mm_skipped: str | None = None  # why this torch cannot run scaled_mm on the CPU for some layer


@dataclass(frozen=True)
class AudioRun:
    """One audio VAE attention run on the (simulated) CUDA platform: what the attention saw and returned."""

    dispatch: str | None
    attention_dtypes: list[str]  # the dtypes in and out of its USPAttention
    out_dtype: str
    bitwise_vs_direct_sdpa: bool | None = None  # default path: equal to the direct causal SDPA of non-CUDA
    direct_dispatch: str | None = None
    max_abs_vs_fp32: float | None = None  # fused paths: against the fp32 direct path
    bound: float | None = None  # one bf16 rounding step at the output's magnitude
    backend_dtype: str | None = None  # fused paths: the dtype the backend computes in


@dataclass(frozen=True)
class AudioFused:
    """``audio_vae=fa``: it ran (``run``) or was refused because flash-attn is missing here (``refused``)."""

    ran: bool
    refused: str | None = None
    run: AudioRun | None = None


@dataclass(frozen=True)
class BranchAgreement:
    max_abs_vs_cpu_branch: dict[str, float]
    max_abs_between_branches: float
    max_abs_vs_fp64: float
    finite: bool


@dataclass(frozen=True)
class VideoDispatch:
    table: dict[str, dict[str, str | None]]  # platform -> dtype -> the branch taken
    agreement: dict[str, BranchAgreement]  # per dtype


@dataclass(frozen=True)
class DriftFigures:
    order_preserving_bitwise: bool
    order_preserving_mae: float
    rotate_to_front_mae: float
    rotate_to_front_max_abs: float
    rotate_to_front_latent_mae: float


@dataclass(frozen=True)
class TurboDrift:
    """The pipeline on one rank and under SP in both caption layouts; latents for the contract's bitwise compare."""

    figures: DriftFigures
    single_latents: np.ndarray
    preserving_latents: np.ndarray
    kernel: str


@dataclass(frozen=True)
class StepRatio:
    single_rank_step_ms: float
    sp_step_ms: float
    ratio: float
    steps_timed: int
