"""Model-level contracts: the reference models under SP, the text encoder, the VAE attention.

They judge figures measured by the target's model checks (:meth:`Target.model_check`: for the
reference, functions in ``harness/targets/reference/``), which return dicts of figures; here
those figures are judged and turned into results. Only a target that runs the reference models
declares ``reference_models``; any other target is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from harness.contracts.bounds import Bound, judge, parse_bound
from harness.contracts.params import LONG_DTYPE, Param, ParamError, Params, bound_param, long_dtype_check
from harness.contracts.registry import Contract, RankContext, register
from harness.contracts.stats import RankOutcome, Stats

_check_models_dtype = long_dtype_check("the models run")

_REFERENCE = frozenset({"reference_models"})


def _path_stats(fig: Mapping[str, Any]) -> Stats:
    """A path's figures (bitwise, max_abs, fp64 errors) as Stats, so the usual bounds judge them."""
    return Stats(
        count=int(fig["numel"]),
        mismatched=0 if fig["bitwise"] else None,
        max_abs=float(fig["max_abs"]),
        err_ref64=float(fig["max_abs_vs_fp64"]),
        naive_err_ref64=float(fig["single_rank_max_abs_vs_fp64"]),
    )


def _judge_paths(paths: Mapping[str, Mapping[str, Any]], bounds: Mapping[str, Bound], kernel: str) -> RankOutcome:
    """Every checked path finite and within its bound; the other paths (controls) are reported only."""
    problems = []
    for name, bound in bounds.items():
        fig = paths[name]
        if not fig["finite"]:
            problems.append(f"{name}: non-finite values in the output")
            continue
        reason = judge(bound, _path_stats(fig))
        if reason:
            problems.append(f"{name}: {reason}")
    checked = [paths[name] for name in bounds]
    extra = {
        "bitwise": all(f["bitwise"] for f in checked),
        "max_abs": max(f["max_abs"] for f in checked),
        "bounds": {name: bound.describe() for name, bound in bounds.items()},
        "paths": dict(paths),
    }
    return RankOutcome(problems=problems, checks=len(bounds), kernel=kernel, extra=extra)


def _kernel(result: Mapping[str, Any]) -> str:
    pinned = f"[{result['sdpa_kernel']}]" if result.get("sdpa_kernel") else ""
    return f"{result['backend']}{pinned} ({result['backend_level']})"




MODEL_PARAMS = (
    Param("world_size", "int", doc="ranks (Ulysses degree = world_size)"),
    Param("dtype", "dtype", "bf16", "fp32, bf16 or fp16"),
    Param("seed", "int", 0, "seed of weights and inputs"),
    Param("batch", "int", 1, "batch size"),
    Param("backend", "str", None, "force an attention backend"),
    Param("sdpa_kernel", "str", None, "pin torch SDPA to math, flash, efficient or cudnn"),
)


def zimage_sp_parity(ctx: RankContext, p: Params) -> RankOutcome:
    # A forced backend or pinned kernel that cannot serve the case is refused by the target (a
    # skip) while the single-rank reference is built: before any collective, on every rank.
    result = ctx.target.model_check("model.zimage_sp_parity")(
        dtype_name=LONG_DTYPE[p.dtype], seed=p.seed, grid_hw=tuple(p.grid), cap_len=p.caption_tokens, batch=p.batch,
        image_grid=tuple(p.image_grid), caption_lengths=tuple(p.caption_lengths),
        backend=p.backend, sdpa_kernel=p.sdpa_kernel, device=str(ctx.device),
    )
    bound = parse_bound(p.bound, p.dtype)
    paths = ("block.image", "block.caption", "transformer", "transformer.masked")
    return _judge_paths(result["paths"], {name: bound for name in paths}, _kernel(result))


def hunyuan_sp_parity(ctx: RankContext, p: Params) -> RankOutcome:
    result = ctx.target.model_check("model.hunyuan_sp_parity")(
        dtype_name=LONG_DTYPE[p.dtype], seed=p.seed, grid_thw=tuple(p.grid), txt_len=p.text_tokens, batch=p.batch,
        text_lengths=tuple(p.text_lengths), masked_text_len=p.masked_text_tokens, backend=p.backend,
        sdpa_kernel=p.sdpa_kernel, device=str(ctx.device),
    )
    ordered, varlen = parse_bound(p.bound, p.dtype), parse_bound(p.varlen_bound, p.dtype)
    bounds = {f"{kind}.{layout}.{part}": varlen if layout == "varlen" else ordered
              for kind in ("double", "single") for layout in ("suffix", "masked", "varlen") for part in ("image", "text")}
    bounds.update({"transformer": ordered, "transformer.masked": ordered, "transformer.varlen": varlen})
    return _judge_paths(result["paths"], bounds, _kernel(result))


def _positive_list(name: str, n: int | None = None) -> Callable[[Params], None]:
    def check(p: Params) -> None:
        value = getattr(p, name)
        if not value or (n is not None and len(value) != n) or min(value) < 1:
            raise ParamError(name, f"needs {n or 'one or more'} positive sizes, got {value}")

    return check


def _check_masked_text(p: Params) -> None:
    """The masked paths pad the text to ``masked_text_tokens`` and shard image + text contiguously."""
    if p.masked_text_tokens < max(p.text_lengths):
        raise ParamError("masked_text_tokens", f"{p.masked_text_tokens} is shorter than the longest item {max(p.text_lengths)}")
    if min(p.text_lengths) == p.masked_text_tokens:
        raise ParamError("text_lengths", f"every item fills the {p.masked_text_tokens} text tokens: the masked paths need padding")
    joint = p.grid[0] * p.grid[1] * p.grid[2] + p.masked_text_tokens
    if joint % p.world_size:
        raise ParamError("masked_text_tokens", f"{joint} image + text tokens do not divide by world_size {p.world_size}")


register(Contract(
    "model.zimage_sp_parity",
    "Z-Image block (caption as replicated suffix) and the faithful transformer under Ulysses SP equal one rank "
    "bitwise: items of one caption length (replicated suffix) and per-item caption masks (the unified sequence "
    "sharded with its mask; in fp32 on the CPU from 2 image tokens per rank); the caption-as-prefix control path is "
    "reported, not judged",
    MODEL_PARAMS + (
        Param("grid", "int_list", [8, 8], "image token grid [h, w] of the block paths"),
        Param("caption_tokens", "int", 6, "caption tokens (the replicated suffix) of the block paths"),
        Param("image_grid", "int_list", [6, 6], "the transformer's image token grid [h, w] (padded to a multiple of 32)"),
        Param("caption_lengths", "int_list", [20, 40], "the transformer's per-item caption lengths (the masked path)"),
        bound_param("bitwise"),
    ),
    zimage_sp_parity,
    requires=_REFERENCE,
    bound=lambda p: parse_bound(p.bound, p.dtype),
    checks=(_check_models_dtype, _positive_list("grid", 2), _positive_list("image_grid", 2), _positive_list("caption_lengths")),
))
register(Contract(
    "model.hunyuan_sp_parity",
    "HunyuanVideo double/single-stream blocks and the faithful transformer under Ulysses SP: text as replicated "
    "suffix and masked text (joint sequence sharded with its key mask) bitwise (in fp32 on the CPU where each rank's "
    "image tokens x MLP width is a multiple of 32 and its GEMMs have more than 4 rows, as at the defaults), sharded "
    "text (seq_lens varlen) within the FlashAttention rule",
    MODEL_PARAMS + (
        Param("grid", "int_list", [2, 4, 4], "video token grid [t, h, w]"),
        Param("text_tokens", "int", 7, "text tokens (not divisible by W gives uneven shards)"),
        Param("text_lengths", "int_list", [7, 3], "per-item valid text tokens of the masked paths"),
        Param("masked_text_tokens", "int", 16, "padded text length of the masked paths (image + it must divide by W)"),
        bound_param("bitwise"),
        Param("varlen_bound", "str", "fa:2", "bound of the sharded-text (varlen) paths"),
    ),
    hunyuan_sp_parity,
    requires=_REFERENCE,
    bound=lambda p: parse_bound(p.bound, p.dtype),
    checks=(_check_models_dtype, _positive_list("grid", 3), _positive_list("text_lengths"), _check_masked_text),
))


# ------------------------------------------------------------------ single-process checks


def _flag_failures(figures: Mapping[str, Any]) -> list[str]:
    """The check's own verdict (``passed``) and, when it failed, which top-level flags were false."""
    if figures.get("passed"):
        return []
    flags = [k for k, v in figures.items() if v is False and k != "passed"]
    mismatches = figures.get("mismatches") or []
    detail = ", ".join([f"{k} is false" for k in flags] + [str(m) for m in mismatches]) or "see the figures"
    return [f"check failed: {detail}"]


def _figures_contract(
    contract_id: str, description: str, params: tuple[Param, ...], call: Callable[[RankContext, Params], dict[str, Any]],
    checks: tuple[Callable[[Params], None], ...] = (),
) -> None:
    """Register a contract around a function that returns figures with ``passed`` (runs on each rank of W=1)."""

    def body(ctx: RankContext, p: Params) -> RankOutcome:
        figures = call(ctx, p)
        kernel = figures.get("backend_masked")  # the encoder check names its attention backend
        return RankOutcome(problems=_flag_failures(figures), checks=1, kernel=kernel,
                           extra={k: v for k, v in figures.items() if k != "passed"})

    register(Contract(contract_id, description, (Param("world_size", "int", 1, "ranks (the check runs on each)"),) + params,
                      body, requires=_REFERENCE, checks=checks))


def _block(p: Params) -> tuple[int, ...] | None:
    return tuple(p.block_size) if p.block_size else None


def _check_block(p: Params) -> None:
    if p.block_size and (len(p.block_size) != 2 or min(p.block_size) < 1):
        raise ParamError("block_size", f"[rows, cols] of positive sizes, or [] for per-tensor scales; got {p.block_size}")


_BLOCK = Param("block_size", "int_list", [32, 48], "FP8 scale blocks [rows, cols]; [] = one scale per tensor")
_SEED = Param("seed", "int", 0, "seed of weights and inputs")

def _masked_causal(ctx: RankContext, p: Params) -> dict[str, Any]:
    return ctx.target.model_check("encoder.masked_causal_lengths")(
        lengths=tuple(p.lengths), num_heads=p.heads, num_kv_heads=p.kv_heads, head_dim=p.head_dim, backend=p.backend,
        seed=p.seed)


def _admission(ctx: RankContext, p: Params) -> dict[str, Any]:
    return ctx.target.model_check("encoder.quantized_admission")(block_size=_block(p), seed=p.seed)


def _packed_qkv(ctx: RankContext, p: Params) -> dict[str, Any]:
    return ctx.target.model_check("encoder.packed_qkv_scale")(block_size=_block(p), seed=p.seed)


def _fp8(ctx: RankContext, p: Params) -> dict[str, Any]:
    return ctx.target.model_check("encoder.fp8_parity")(block_size=_block(p), lengths=tuple(p.lengths), seed=p.seed)


def _audio(ctx: RankContext, p: Params) -> dict[str, Any]:
    return ctx.target.model_check("vae.audio_fp32_restored")(device=str(ctx.device), seed=p.seed)


def _video(ctx: RankContext, p: Params) -> dict[str, Any]:
    return ctx.target.model_check("vae.video_dispatch")(device=str(ctx.device), seed=p.seed)


_figures_contract(
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
)
_figures_contract(
    "encoder.quantized_admission",
    "a quantized checkpoint is admitted only by a native encoder that builds quantized linears; every "
    "rejection happens before one tensor is read (fail closed)",
    (_BLOCK, _SEED),
    _admission,
    (_check_block,),
)
_figures_contract(
    "encoder.packed_qkv_scale",
    "q/k/v (and gate/up) weights and weight_scale_inv land bit for bit in their shard of the fused parameter",
    (Param("block_size", "int_list", [], "FP8 scale blocks [rows, cols]; [] = one scale per tensor"), _SEED),
    _packed_qkv,
    (_check_block,),
)
_figures_contract(
    "encoder.fp8_parity",
    "the FP8 encoder equals a bf16 encoder on its dequantized weights bitwise, and stays within the measured "
    "bound of its bf16 source",
    (_BLOCK, Param("lengths", "int_list", [7, 3, 10], "valid tokens per row"), _SEED),
    _fp8,
    (_check_block,),
)
_figures_contract(
    "vae.audio_fp32_restored",
    "audio VAE attention: fp32 in, fp32 out, by default (TORCH_SDPA) and through a fused backend's cast-and-restore",
    (_SEED,),
    _audio,
)
_figures_contract(
    "vae.video_dispatch",
    "video VAE attention takes the expected branch per (platform, dtype) (CUDA half → USPAttention, fp32 and "
    "non-CUDA → SDPA, ROCm gfx95 → SDPA math) and the branches agree",
    (_SEED,),
    _video,
)
