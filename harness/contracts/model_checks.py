"""Single-process model checks: the text encoder's masked causal attention and FP8 loading, the VAE attention.

Each contract judges the typed figures one check measured (:mod:`harness.targets.figures`): the bounds and
expectations live here, next to the verdict; the checks in the target only measure. Only a target running
the reference models declares ``reference_models``; any other is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from harness.contracts.judging import RankOutcome
from harness.contracts.params import Param, ParamError, Params
from harness.contracts.registry import Contract, RankContext, register
from harness.targets.base import Capability
from harness.targets.figures import (
    Admission,
    AudioFused,
    AudioRun,
    Fp8Parity,
    MaskedCausal,
    PackedQkv,
    VideoDispatch,
    reported,
)

_REFERENCE = frozenset({Capability.REFERENCE_MODELS})


def _failed(checks: Mapping[str, bool]) -> list[str]:
    """The named conditions of a check that do not hold, as its one problem (the figures show the values)."""
    failed = [name for name, held in checks.items() if not held]
    return [f"check failed: {', '.join(failed)}"] if failed else []


Judge = Callable[[Any], tuple[list[str], dict[str, Any]]]  # typed figures -> (problems, the result's figures)


def figures_contract(
    contract_id: str,
    description: str,
    params: tuple[Param, ...],
    call: Callable[[RankContext, Params], Any],
    verdict: Judge,
    checks: tuple[Callable[[Params], None], ...] = (),
    kernel: Callable[[Any], str | None] = lambda f: None,
) -> Contract:
    """A contract that judges one model check's typed figures (runs on each rank of W=1)."""

    def body(ctx: RankContext, p: Params) -> RankOutcome:
        figures = call(ctx, p)
        problems, reported_figures = verdict(figures)
        return RankOutcome(problems=problems, checks=1, kernel=kernel(figures), figures=reported_figures)

    return Contract(
        contract_id,
        description,
        (Param("world_size", "int", 1, "ranks (the check runs on each)"),) + params,
        body,
        requires=_REFERENCE,
        checks=checks,
    )


def _block(p: Params) -> tuple[int, ...] | None:
    return tuple(p.block_size) if p.block_size else None


def _check_block(p: Params) -> None:
    if p.block_size and (len(p.block_size) != 2 or min(p.block_size) < 1):
        raise ParamError(
            "block_size", f"[rows, cols] of positive sizes, or [] for per-tensor scales; got {p.block_size}"
        )


_BLOCK = Param("block_size", "int_list", [32, 48], "FP8 scale blocks [rows, cols]; [] = one scale per tensor")
_SEED = Param("seed", "int", 0, "seed of weights and inputs")

# Bounds, each over the worst of seeds 0-7 measured on the tiny configs, with a margin.
MASKED_CAUSAL_BOUND = 1e-5  # fp32 attention vs the fp64 reference; measured <= 3.9e-7
# FP8 vs bf16 source, ||out - ref|| / ||ref|| over valid tokens of last_hidden_state: measured
# <= 0.069 (per tensor and 32x48 blocks, 2 layers), 0.044 (128x128 blocks, hidden 256, 1 layer).
FP8_REL_L2_BOUND = 0.1
SCALED_MM_REL_L2_BOUND = 0.15  # FP8 weights and dynamic FP8 activations (CPU _scaled_mm); measured <= 0.092


def _masked_causal(ctx: RankContext, p: Params) -> MaskedCausal:
    return ctx.target.model_check("encoder.masked_causal_lengths")(
        lengths=tuple(p.lengths),
        num_heads=p.heads,
        num_kv_heads=p.kv_heads,
        head_dim=p.head_dim,
        backend=p.backend,
        seed=p.seed,
    )


def judge_masked_causal(f: MaskedCausal) -> tuple[list[str], dict[str, Any]]:
    problems = _failed(
        {
            "finite": f.finite,
            "zero_rows_exactly_zero": f.zero_rows_exactly_zero,
            "full_batch_plain_causal": f.full_batch_plain_causal,
            f"max abs <= {MASKED_CAUSAL_BOUND:g}": max(f.max_abs, f.max_abs_full) <= MASKED_CAUSAL_BOUND,
        }
    )
    return problems, {**reported(f), "bound": MASKED_CAUSAL_BOUND}


def _admission(ctx: RankContext, p: Params) -> Admission:
    return ctx.target.model_check("encoder.quantized_admission")(block_size=_block(p), seed=p.seed)


def judge_admission(f: Admission) -> tuple[list[str], dict[str, Any]]:
    rejected = f.rejections.values()
    problems = _failed(
        {
            "every tensor read when admitted": f.admitted_tensors_read == f.checkpoint_tensors,
            "every linear quantized and processed": f.quantized_layers
            == f.processed_layers
            == f.expected_quantized_layers,
            "every rejection before any read, naming the component": all(
                r.rejected and r.tensors_read == 0 and r.names_component for r in rejected
            ),
            "the rejections of an encoder class name it": all(
                f.rejections[c].names_class for c in ("native_without_quantized_layers", "not_native")
            ),
        }
    )
    figures = {**reported(f), "rejections": {case: reported(r) for case, r in f.rejections.items()}}
    return problems, figures


def _packed_qkv(ctx: RankContext, p: Params) -> PackedQkv:
    return ctx.target.model_check("encoder.packed_qkv_scale")(block_size=_block(p), seed=p.seed)


def judge_packed_qkv(f: PackedQkv) -> tuple[list[str], dict[str, Any]]:
    return _failed({"bit_exact": f.bit_exact, "distinct_shard_scales": f.distinct_shard_scales}), reported(f)


def _fp8(ctx: RankContext, p: Params) -> Fp8Parity:
    return ctx.target.model_check("encoder.fp8_parity")(block_size=_block(p), lengths=tuple(p.lengths), seed=p.seed)


def judge_fp8(f: Fp8Parity) -> tuple[list[str], dict[str, Any]]:
    checks = {
        "bitwise_vs_dequantized_bf16": f.bitwise_vs_dequantized_bf16,
        f"rel_l2_vs_bf16 <= {FP8_REL_L2_BOUND:g}": f.rel_l2_vs_bf16 <= FP8_REL_L2_BOUND,
    }
    figures = {**reported(f), "bound_rel_l2": FP8_REL_L2_BOUND}
    if f.rel_l2_scaled_mm_vs_bf16 is not None:
        checks[f"rel_l2_scaled_mm_vs_bf16 <= {SCALED_MM_REL_L2_BOUND:g}"] = (
            f.rel_l2_scaled_mm_vs_bf16 <= SCALED_MM_REL_L2_BOUND
        )
        figures["bound_rel_l2_scaled_mm"] = SCALED_MM_REL_L2_BOUND
    return _failed(checks), figures


# Which branch the video VAE attention must take per (platform, dtype); "usp" matches "usp:<backend>".
EXPECTED_DISPATCH = {
    (platform, dtype): (
        "usp" if platform == "cuda" and dtype != "fp32" else "sdpa-math" if platform == "rocm:gfx950" else "sdpa"
    )
    for platform in ("cpu", "mps", "cuda", "rocm:gfx950", "rocm:gfx942")
    for dtype in ("fp32", "bf16")
}
# Max abs difference allowed between any two branches of one dtype. fp32: accumulation-order
# noise of different SDPA kernels; bf16: one bf16 rounding step of O(1) outputs (2^-7 = 7.8e-3).
CROSS_BRANCH_BOUND = {"fp32": 1e-5, "bf16": 1e-2}


def _video(ctx: RankContext, p: Params) -> VideoDispatch:
    return ctx.target.model_check("vae.video_dispatch")(device=str(ctx.device), seed=p.seed)


def judge_video(f: VideoDispatch) -> tuple[list[str], dict[str, Any]]:
    mismatches = [
        f"{platform}/{dtype}: expected {want}, ran {f.table.get(platform, {}).get(dtype)}"
        for (platform, dtype), want in EXPECTED_DISPATCH.items()
        if (f.table.get(platform, {}).get(dtype) or "").split(":")[0] != want
    ]
    agreement = {
        dtype: {
            **reported(a),
            "bound": CROSS_BRANCH_BOUND[dtype],
            "within_bound": a.max_abs_between_branches <= CROSS_BRANCH_BOUND[dtype],
        }
        for dtype, a in f.agreement.items()
    }
    held = {
        f"{dtype} branches finite and within {agreement[dtype]['bound']:g}": a["finite"] and a["within_bound"]
        for dtype, a in agreement.items()
    }
    problems = _failed(held)
    if mismatches:
        problems = [f"check failed: {', '.join(mismatches)}"] + problems
    return problems, {"table": f.table, "mismatches": mismatches, "agreement": agreement}


register(
    figures_contract(
        "encoder.masked_causal_lengths",
        "Qwen3 encoder masked causal attention vs an fp64 per-row reference: valid rows causal, padding rows "
        "over the valid keys, zero-length rows zero, all-full batches plain causal; GQA",
        (
            Param("lengths", "int_list", [7, 3, 10, 0, 1], "valid tokens per row"),
            Param("heads", "int", 4, "query heads"),
            Param("kv_heads", "int", 2, "K/V heads"),
            Param("head_dim", "int", 16, "head dim"),
            Param("backend", "str", None, "text_encoder backend override"),
            _SEED,
        ),
        _masked_causal,
        judge_masked_causal,
        # the encoder check names its attention backend
        kernel=lambda f: f.backend_masked,
    )
)
register(
    figures_contract(
        "encoder.quantized_admission",
        "a quantized checkpoint is admitted only by a native encoder that builds quantized linears; every "
        "rejection happens before one tensor is read (fail closed)",
        (_BLOCK, _SEED),
        _admission,
        judge_admission,
        (_check_block,),
    )
)
register(
    figures_contract(
        "encoder.packed_qkv_scale",
        "q/k/v (and gate/up) weights and weight_scale_inv land bit for bit in their shard of the fused parameter",
        (Param("block_size", "int_list", [], "FP8 scale blocks [rows, cols]; [] = one scale per tensor"), _SEED),
        _packed_qkv,
        judge_packed_qkv,
        (_check_block,),
    )
)
register(
    figures_contract(
        "encoder.fp8_parity",
        "the FP8 encoder equals a bf16 encoder on its dequantized weights bitwise, and stays within the measured "
        "bound of its bf16 source",
        (_BLOCK, Param("lengths", "int_list", [7, 3, 10], "valid tokens per row"), _SEED),
        _fp8,
        judge_fp8,
        (_check_block,),
    )
)
register(
    figures_contract(
        "vae.video_dispatch",
        "video VAE attention takes the expected branch per (platform, dtype) (CUDA half → USPAttention, fp32 and "
        "non-CUDA → SDPA, ROCm gfx95 → SDPA math) and the branches agree",
        (_SEED,),
        _video,
        judge_video,
    )
)


def judge_audio(default: AudioRun, fa: AudioFused, cast: AudioRun) -> tuple[list[str], dict[str, Any]]:
    """Three checks on the (simulated) CUDA platform, each its own model check: fp32 in, fp32 out.

    ``default``: TORCH_SDPA, no cast, equal to the direct causal SDPA of the non-CUDA path.
    ``fa``: ``audio_vae=fa`` runs (fp32 out, the attention at the backend dtype) or is refused because
    flash-attn is missing here; a silent fallback to SDPA fails. ``cast_restore``: a bf16 MATH backend
    sees bf16 q/k/v, the caller gets fp32 back, within one bf16 rounding step of the fp32 path.
    """
    fp32, bf16 = str(torch.float32), str(torch.bfloat16)
    problems = _failed(
        {
            f"default: {name}": held
            for name, held in {
                "TORCH_SDPA through USPAttention": default.dispatch == "usp:torch_sdpa",
                "fp32 in and out of the attention": default.attention_dtypes == [fp32, fp32],
                "fp32 out": default.out_dtype == fp32,
                "bitwise to the direct SDPA": bool(default.bitwise_vs_direct_sdpa),
            }.items()
        }
    )
    if fa.run is not None:
        run = fa.run
        problems += _failed(
            {
                f"fa: {name}": held
                for name, held in {
                    "fp32 out": run.out_dtype == fp32,
                    "the attention at the backend dtype": run.attention_dtypes[:1] == [run.backend_dtype],
                    "within one bf16 step of fp32": _within(run.max_abs_vs_fp32, run.bound),
                }.items()
            }
        )
    problems += _failed(
        {
            f"cast_restore: {name}": held
            for name, held in {
                "bf16 in and out of the attention": cast.attention_dtypes == [bf16, bf16],
                "fp32 out": cast.out_dtype == fp32,
                "cast (differs from fp32) within one bf16 step": (cast.max_abs_vs_fp32 or 0.0) > 0.0
                and _within(cast.max_abs_vs_fp32, cast.bound),
            }.items()
        }
    )
    fa_figures = {"ran": True, **reported(fa.run)} if fa.run is not None else reported(fa)
    return problems, {"default": reported(default), "fa": fa_figures, "cast_restore": reported(cast)}


def _within(value: float | None, bound: float | None) -> bool:
    return value is not None and bound is not None and value <= bound


def audio_fp32_restored(ctx: RankContext, p: Params) -> RankOutcome:
    def check(name: str) -> Any:
        return ctx.target.model_check(name)(device=str(ctx.device), seed=p.seed)

    problems, figures = judge_audio(check("vae.audio_default"), check("vae.audio_fa"), check("vae.audio_cast_restore"))
    return RankOutcome(problems=problems, checks=3, figures=figures)


register(
    Contract(
        "vae.audio_fp32_restored",
        "audio VAE attention: fp32 in, fp32 out, by default (TORCH_SDPA) and through a fused backend's cast-and-restore",
        (Param("world_size", "int", 1, "ranks (the check runs on each)"), _SEED),
        audio_fp32_restored,
        requires=_REFERENCE,
    )
)
