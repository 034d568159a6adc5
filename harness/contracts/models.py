"""Model-level contracts: the reference DiTs (Z-Image, HunyuanVideo) under SP against one rank and float64.

Each judges the typed figures of a model check (:meth:`Target.model_check`,
:mod:`harness.targets.figures`): the bounds and expectations live here, next to the verdict, and the
checks only measure. Only a target that runs the reference models declares ``reference_models``;
any other target is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from harness.contracts.bounds import Bound, judge, parse_bound
from harness.contracts.judging import RankOutcome
from harness.contracts.params import LONG_DTYPE, Param, ParamError, Params, bound_param, long_dtype_check
from harness.contracts.registry import Contract, RankContext, register
from harness.contracts.stats import Stats
from harness.targets.base import Capability
from harness.targets.figures import (
    ModelParity,
    PathFigures,
    reported,
)

_check_models_dtype = long_dtype_check("the models run")

_REFERENCE = frozenset({Capability.REFERENCE_MODELS})


def _path_stats(fig: PathFigures) -> Stats:
    """A path's figures (bitwise, max_abs, fp64 errors) as Stats, so the usual bounds judge them."""
    return Stats(
        count=fig.numel,
        mismatched=0 if fig.bitwise else None,
        max_abs=fig.max_abs,
        err_ref64=fig.max_abs_vs_fp64,
        naive_err_ref64=fig.single_rank_max_abs_vs_fp64,
    )


def describe_where(where: Mapping[str, Any]) -> str:
    """A path's located difference (:func:`harness.targets.reference.locate.locate`) in words: the worst element
    by axis, then per rank (or item) the positions at least half as far off, and how many channels."""
    worst = ", ".join(f"{axis} {i}" for axis, i in where["worst"].items() if axis != "abs")
    groups = ", ".join(f"{name} ({hit} of {n})" for name, (hit, n) in where["above_half"].items() if hit)
    return (
        f"worst at {worst} (|Δ| {where['worst']['abs']:.4g}); above half the worst: {groups}; "
        f"{where['channels_above_half']} of {where['channels']} channels"
    )


def _judge_paths(result: ModelParity, bounds: Mapping[str, Bound]) -> RankOutcome:
    """Every checked path finite and within its bound; the other paths (controls) are reported only."""
    problems = []
    for name, bound in bounds.items():
        fig = result.paths[name]
        if not fig.finite:
            problems.append(f"{name}: non-finite values in the output")
            continue
        reason = judge(bound, _path_stats(fig))
        if reason:
            problems.append(f"{name}: {reason}" + (f" [{describe_where(fig.where)}]" if fig.where else ""))
    checked = [result.paths[name] for name in bounds]
    figures = {
        "bitwise": all(f.bitwise for f in checked),
        "max_abs": max(f.max_abs for f in checked),
        "bounds": {name: bound.describe() for name, bound in bounds.items()},
        "paths": {name: reported(f) for name, f in result.paths.items()},
    }
    return RankOutcome(problems=problems, checks=len(bounds), kernel=result.kernel, figures=figures)


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
    result: ModelParity = ctx.target.model_check("model.zimage_sp_parity")(
        dtype_name=LONG_DTYPE[p.dtype],
        seed=p.seed,
        grid_hw=tuple(p.grid),
        cap_len=p.caption_tokens,
        batch=p.batch,
        image_grid=tuple(p.image_grid),
        caption_lengths=tuple(p.caption_lengths),
        backend=p.backend,
        sdpa_kernel=p.sdpa_kernel,
        device=str(ctx.device),
    )
    paths = ("block.image", "block.caption", "transformer", "transformer.masked")
    return _judge_paths(result, {name: ctx.bound for name in paths})


def hunyuan_sp_parity(ctx: RankContext, p: Params) -> RankOutcome:
    result: ModelParity = ctx.target.model_check("model.hunyuan_sp_parity")(
        dtype_name=LONG_DTYPE[p.dtype],
        seed=p.seed,
        grid_thw=tuple(p.grid),
        txt_len=p.text_tokens,
        batch=p.batch,
        text_lengths=tuple(p.text_lengths),
        masked_text_len=p.masked_text_tokens,
        backend=p.backend,
        sdpa_kernel=p.sdpa_kernel,
        device=str(ctx.device),
    )
    ordered, varlen = ctx.bound, parse_bound(p.varlen_bound, p.dtype)
    bounds = {
        f"{kind}.{layout}.{part}": varlen if layout == "varlen" else ordered
        for kind in ("double", "single")
        for layout in ("suffix", "masked", "varlen")
        for part in ("image", "text")
    }
    bounds.update({"transformer": ordered, "transformer.masked": ordered, "transformer.varlen": varlen})
    return _judge_paths(result, bounds)


def _positive_list(name: str, n: int | None = None) -> Callable[[Params], None]:
    def check(p: Params) -> None:
        value = getattr(p, name)
        if not value or (n is not None and len(value) != n) or min(value) < 1:
            raise ParamError(name, f"needs {n or 'one or more'} positive sizes, got {value}")

    return check


def _check_masked_text(p: Params) -> None:
    """The masked paths pad the text to ``masked_text_tokens`` and shard image + text contiguously."""
    if p.masked_text_tokens < max(p.text_lengths):
        raise ParamError(
            "masked_text_tokens", f"{p.masked_text_tokens} is shorter than the longest item {max(p.text_lengths)}"
        )
    if min(p.text_lengths) == p.masked_text_tokens:
        raise ParamError(
            "text_lengths", f"every item fills the {p.masked_text_tokens} text tokens: the masked paths need padding"
        )
    joint = p.grid[0] * p.grid[1] * p.grid[2] + p.masked_text_tokens
    if joint % p.world_size:
        raise ParamError(
            "masked_text_tokens", f"{joint} image + text tokens do not divide by world_size {p.world_size}"
        )


register(
    Contract(
        "model.zimage_sp_parity",
        "Z-Image block (caption as replicated suffix) and the faithful transformer under Ulysses SP equal one rank "
        "bitwise: items of one caption length (replicated suffix) and per-item caption masks (the unified sequence "
        "sharded with its mask; in fp32 on the CPU from 2 image tokens per rank); the caption-as-prefix control path is "
        "reported, not judged",
        MODEL_PARAMS
        + (
            Param("grid", "int_list", [8, 8], "image token grid [h, w] of the block paths"),
            Param("caption_tokens", "int", 6, "caption tokens (the replicated suffix) of the block paths"),
            Param(
                "image_grid",
                "int_list",
                [6, 6],
                "the transformer's image token grid [h, w] (padded to a multiple of 32)",
            ),
            Param(
                "caption_lengths", "int_list", [20, 40], "the transformer's per-item caption lengths (the masked path)"
            ),
            bound_param("bitwise"),
        ),
        zimage_sp_parity,
        requires=_REFERENCE,
        bound=lambda p: parse_bound(p.bound, p.dtype),
        checks=(
            _check_models_dtype,
            _positive_list("grid", 2),
            _positive_list("image_grid", 2),
            _positive_list("caption_lengths"),
        ),
    )
)
register(
    Contract(
        "model.hunyuan_sp_parity",
        "HunyuanVideo double/single-stream blocks and the faithful transformer under Ulysses SP: text as replicated "
        "suffix and masked text (joint sequence sharded with its key mask) bitwise (in fp32 on the CPU where each rank's "
        "image tokens x MLP width is a multiple of 32 and its GEMMs have more than 4 rows, as at the defaults), sharded "
        "text (seq_lens varlen) within the FlashAttention rule",
        MODEL_PARAMS
        + (
            Param("grid", "int_list", [2, 4, 4], "video token grid [t, h, w]"),
            Param("text_tokens", "int", 7, "text tokens (not divisible by W gives uneven shards)"),
            Param("text_lengths", "int_list", [7, 3], "per-item valid text tokens of the masked paths"),
            Param(
                "masked_text_tokens", "int", 16, "padded text length of the masked paths (image + it must divide by W)"
            ),
            bound_param("bitwise"),
            Param("varlen_bound", "str", "fa:2", "bound of the sharded-text (varlen) paths"),
        ),
        hunyuan_sp_parity,
        requires=_REFERENCE,
        bound=lambda p: parse_bound(p.bound, p.dtype),
        checks=(_check_models_dtype, _positive_list("grid", 3), _positive_list("text_lengths"), _check_masked_text),
    )
)
