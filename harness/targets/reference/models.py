"""Model checks of the model-level SP parity contracts: shared machinery and Z-Image (``model.zimage_sp_parity``).

Each worker runs on every rank of a live group and compares a sequence-parallel run of a
reference model with the single-rank run of the same weights on the same inputs, computed in the
same process before sequence parallelism is set up (a genuine one-rank forward), and with a
float64 copy. Outputs are gathered, so every rank returns the same :class:`ModelParity`; the
contracts judge it. Bitwise model parity also needs row-count invariant GEMMs (a rank runs
``S/W + S_rep`` rows, one rank ``S + S_rep``): measured facts on that are below.
"""

from __future__ import annotations

# Row-count invariance, measured. On an H200 (torch 2.11, cu130) cuBLAS fp32 GEMMs are not
# row-count invariant (max 1.8e-5 at K=3840, 1030 vs 518 rows; even K=64, 32 vs 16 rows), so fp32
# figures there are not bitwise; bf16 GEMMs were at every shape tried, and CPU GEMMs in fp32 and
# bf16 down to a few rows. CPU exceptions (torch 2.13, MKL): fp32 GEMMs of 4 rows or fewer (K=128)
# take another kernel, and a linear layer fuses its bias in bf16 only for contiguous 3-D input. The
# masked layout shards [image | text] contiguously, so a rank can hold a sliver of one stream: at
# W=4 with 32 image + 8 text tokens rank 3 holds 2 image tokens per item and the fp32 output moves
# by 2.4e-7 (within the FlashAttention rule); the default masked shape (16 text tokens) leaves every
# rank at least 4 tokens of a stream it holds, so there the masked paths are bitwise.
import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from harness.ranks import rank_device
from harness.targets.figures import ModelParity, PathFigures
from harness.targets.reference.locate import locate
from reference_impl.attention.backends import MathBackend, pinned_sdpa_kernel
from reference_impl.attention.layer import LocalAttention, USPAttention
from reference_impl.attention.selector import attention_backend_config
from reference_impl.forward_context import set_forward_context
from reference_impl.models.layers import even_shard_bounds, grid_positions
from reference_impl.models.zimage import ZImageConfig, ZImageTransformerBlock, zimage_rope
from reference_impl.models.zimage_transformer import ZImageTransformer, caption_positions
from reference_impl.parallel import comm
from reference_impl.parallel.state import destroy_sequence_parallel, get_ulysses_group, init_sequence_parallel

Tensor = torch.Tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Tiny architectures (diffusers config keys for the transformers): heads divisible by 2 and 4
# so the same worker runs at W = 1, 2, 4 (HunyuanVideo's: :mod:`.hunyuan_parity`).
ZIMAGE_TINY = dict(
    in_channels=4,
    dim=64,
    n_layers=2,
    n_refiner_layers=2,
    n_heads=4,
    n_kv_heads=4,
    cap_feat_dim=32,
    axes_dims=[4, 6, 6],
    axes_lens=[1024, 64, 64],
)


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def run_device(device: str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    try:
        return rank_device()
    except RuntimeError:  # a group the caller started itself
        return torch.device("cpu")


@contextmanager
def pinned_backend(backend: str | None) -> Iterator[None]:
    with attention_backend_config({"force": backend}) if backend else nullcontext():
        yield


def seeded_inputs(seed: int, device: torch.device, dtype: torch.dtype) -> Callable[..., Tensor]:
    """Seeded random inputs already rounded to ``dtype``, so the fp64 reference sees the very same values."""
    gen = torch.Generator().manual_seed(seed + 1)
    return lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)


def table_dtype(model: torch.nn.Module) -> torch.dtype:
    """RoPE tables in fp32, or fp64 for the fp64 reference copy (so its only rounding is fp64's)."""
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


def path_figures(out: Tensor, ref: Tensor, ref64: Tensor, owners: Tensor | None = None) -> PathFigures:
    """``out`` against one rank's ``ref`` and float64's ``ref64``; ``owners``: the rank of each token (dim 1)."""
    d = (out.double() - ref.double()).abs()
    return PathFigures(
        bitwise=bool(torch.equal(out, ref)),
        finite=bool(torch.isfinite(out).all()),
        max_abs=d.max().item(),
        mean_abs=d.mean().item(),
        max_abs_vs_fp64=(out.double() - ref64).abs().max().item(),
        single_rank_max_abs_vs_fp64=(ref.double() - ref64).abs().max().item(),
        numel=out.numel(),
        where=locate(d, owners),
    )


def gather_output(t: Tensor) -> Tensor:
    """Every rank's tokens, in rank order (sharded outputs: the full sequence; replicated: W copies)."""
    return comm.all_gather(t.contiguous(), dim=1, group=get_ulysses_group())


def gathered(t: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`gather_output` of ``t`` and the rank that computed each of its tokens (to say where a difference is)."""
    mine = torch.full((1, t.shape[1], 1), float(dist.get_rank()), device=t.device)
    return gather_output(t), gather_output(mine)[0, :, 0].long()


def reference_outputs(
    fn: Callable[..., Any], model: torch.nn.Module, args: tuple[Tensor, ...], sdpa_kernel: str | None
) -> tuple[Any, Any]:
    """Single-rank outputs in the model's dtype (kernel pinned like the SP run) and in fp64 (:func:`float64_copy`).
    Masks (bool or integer tensors) are passed unchanged."""
    with pinned_sdpa_kernel(sdpa_kernel):
        low = fn(model, *args)
    high = fn(float64_copy(model), *(a.double() if a.is_floating_point() else a for a in args))
    return low, high


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in float64, every attention layer computing through the MATH backend: fused kernels
    (flash-attn) have no fp64, and an oracle must not share the kernel under test."""
    exact = copy.deepcopy(model).double()
    for layer in exact.modules():
        if isinstance(layer, (USPAttention, LocalAttention)):
            layer.attn_impl = MathBackend()
    return exact


def run_worker(
    reference: Callable[[], Any],
    sharded: Callable[[int, int, Any], dict[str, PathFigures]],
    attn: USPAttention,
    setup: dict[str, Any],
    sdpa_kernel: str | None,
) -> ModelParity:
    """``reference()`` on one rank, then ``sharded(rank, world, refs)`` under Ulysses SP = world (kernel pinned)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    destroy_sequence_parallel()  # the reference must run on one rank, whatever a previous call left
    try:
        with torch.no_grad(), set_forward_context():
            refs = reference()
            init_sequence_parallel(world, 1)
            with pinned_sdpa_kernel(sdpa_kernel):
                paths = sharded(rank, world, refs)
    finally:
        destroy_sequence_parallel()
    # The SDPA kernel pinned around the low-precision runs (None: torch chose).
    return ModelParity(
        paths,
        attn.backend.value,
        attn.selection.level,
        sdpa_kernel or getattr(attn.attn_impl, "kernel", None),
        rank,
        world,
        setup,
    )


# ---------------------------------------------------------------------------- Z-Image
# long: one rank's Z-Image check reads as the model runs it: build, shard, run, gather, compare each path
def zimage_sp_parity_worker(
    dtype_name: str = "bfloat16",
    seed: int = 0,
    *,
    grid_hw: tuple[int, int] = (8, 8),
    cap_len: int = 6,
    batch: int = 1,
    image_grid: tuple[int, int] = (6, 6),
    caption_lengths: tuple[int, ...] = (20, 40),
    config: Mapping[str, Any] | None = None,
    backend: str | None = None,
    sdpa_kernel: str | None = None,
    device: str | None = None,
) -> ModelParity:
    """Z-Image block (caption as replicated suffix) and the faithful ZImageTransformer, SP=W vs one rank.

    Paths: ``block.image``, ``block.caption`` (every rank's copy) on a ``grid_hw`` image and a
    ``cap_len`` caption; ``transformer``: one item per entry of ``caption_lengths``, each
    with the first length (one padded length: caption as the replicated suffix);
    ``transformer.masked``: the items with their own lengths (20 and 40 pad to 32 and 64, so
    a per-item key mask: the unified sequence sharded contiguously). The transformer's image
    is ``image_grid`` tokens (36: padded to 64). All expected bitwise; and
    ``control.block.caption_as_prefix.image``, the caption rotated to the front (expected *not*
    bitwise: the drift order preservation removes). Ulysses degree = the group's world size,
    ring degree 1. ``config`` overrides keys of :data:`ZIMAGE_TINY`; ``backend`` forces the
    attention backend, ``sdpa_kernel`` pins torch's SDPA kernel for the low-precision runs.
    """
    dtype, dev = torch_dtype(dtype_name), run_device(device)
    with pinned_backend(backend):
        torch.manual_seed(seed)
        cfg = ZImageConfig.from_dict({**ZIMAGE_TINY, **(config or {})})
        block = ZImageTransformerBlock(cfg, compute_dtype=dtype).to(dev, dtype)
        model = ZImageTransformer(cfg, compute_dtype=dtype).to(dev, dtype)
        with torch.no_grad():  # the learned pad tokens start at zero: make them visible
            model.x_pad_token.normal_()
            model.cap_pad_token.normal_()
    attn = block.attention.attn
    rand = seeded_inputs(seed, dev, dtype)
    n_img = grid_hw[0] * grid_hw[1]
    img, cap = rand(batch, n_img, cfg.dim), rand(batch, cap_len, cfg.dim)
    adaln = rand(batch, cfg.adaln_embed_dim)
    positions = torch.cat([grid_positions((1, *grid_hw), (cap_len + 1, 0, 0), dev), caption_positions(cap_len, dev)])
    p = cfg.all_patch_size[0]
    latents = [rand(cfg.in_channels, 1, image_grid[0] * p, image_grid[1] * p) for _ in caption_lengths]
    t = rand(len(caption_lengths)).abs()
    captions = [rand(n, cfg.cap_feat_dim) for n in caption_lengths]
    uniform = [rand(caption_lengths[0], cfg.cap_feat_dim) for _ in caption_lengths]

    def block_full(m: torch.nn.Module, img_: Tensor, cap_: Tensor, ada: Tensor) -> Tensor:
        rope = zimage_rope(cfg, positions, table_dtype(m))
        return m(torch.cat([img_, cap_], dim=1), rope, ada, num_replicated_suffix=cap_len)

    def transformer(m: torch.nn.Module, t_: Tensor, *tensors: Tensor) -> Tensor:
        n = len(tensors) // 2
        return torch.stack(m(list(tensors[:n]), t_, list(tensors[n:])))

    def reference() -> tuple[Any, Any, Any]:
        return (
            reference_outputs(block_full, block, (img, cap, adaln), sdpa_kernel),
            reference_outputs(transformer, model, (t, *latents, *uniform), sdpa_kernel),
            reference_outputs(transformer, model, (t, *latents, *captions), sdpa_kernel),
        )

    def sharded(rank: int, world: int, refs: tuple[Any, Any, Any]) -> dict[str, PathFigures]:
        (ref, ref64), (uni_ref, uni_ref64), (mask_ref, mask_ref64) = refs
        start, end = even_shard_bounds(n_img, rank, world)
        rows = torch.cat([positions[start:end], positions[n_img:]])
        rope = zimage_rope(cfg, rows)
        out = block(torch.cat([img[:, start:end], cap], dim=1), rope, adaln, num_replicated_suffix=cap_len)
        (out_img, img_ranks), (out_cap, cap_ranks) = gathered(out[:, : end - start]), gathered(out[:, end - start :])
        # Control: the caption rotated to the front as a replicated *prefix* (sglang's old suffix
        # path). Same maths, another K/V scan order: shows what order preservation buys.
        rot = block(
            torch.cat([cap, img[:, start:end]], dim=1),
            (rope[0].roll(cap_len, 0), rope[1].roll(cap_len, 0)),
            adaln,
            num_replicated_prefix=cap_len,
        )
        return {
            "block.image": path_figures(out_img, ref[:, :n_img], ref64[:, :n_img], img_ranks),
            "block.caption": path_figures(
                out_cap, ref[:, n_img:].repeat(1, world, 1), ref64[:, n_img:].repeat(1, world, 1), cap_ranks
            ),
            "transformer": path_figures(transformer(model, t, *latents, *uniform), uni_ref, uni_ref64),
            "transformer.masked": path_figures(transformer(model, t, *latents, *captions), mask_ref, mask_ref64),
            "control.block.caption_as_prefix.image": path_figures(
                gather_output(rot[:, cap_len:]), ref[:, :n_img], ref64[:, :n_img], img_ranks
            ),
        }

    setup = {"model": "zimage", "dtype": dtype_name, "seed": seed, "caption_lengths": list(caption_lengths)}
    return run_worker(reference, sharded, attn, setup, sdpa_kernel)
