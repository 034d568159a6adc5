"""Per-rank workers for the model-level SP parity contracts (``model.zimage_sp_parity``, ``model.hunyuan_sp_parity``).

Each worker runs on every rank of a live process group (``harness.launcher.run_on_ranks``)
and compares a sequence-parallel run of a reference model against the single-rank run of
the same weights on the same inputs, computed *in the same process before* sequence
parallelism is initialised (so the reference is a genuine one-rank forward). Sharded
outputs are all-gathered and replicated outputs (caption/text) are gathered from every
rank, so every rank returns the same, global figures.

Figures per path: ``bitwise`` (``torch.equal`` with the single-rank output), ``finite``,
``max_abs`` / ``mean_abs`` against single rank, and for the FlashAttention rule
``max_abs_vs_fp64`` (SP output vs an fp64 single-rank run) and
``single_rank_max_abs_vs_fp64`` (single-rank low-precision vs fp64). Verdicts and bounds are
the contract's business; these functions only measure.

Model-level bitwise parity needs more than head-count-invariant attention: every row-wise op
must give a token the same result whatever the number of rows in the call (a rank runs its
GEMMs on ``S/W + S_rep`` rows, one rank on ``S + S_rep``). On an H200 (torch 2.11, cu130)
cuBLAS fp32 GEMMs are not row-count invariant (max 1.8e-5 at K=3840, 1030 vs 518 rows; even
K=64, 32 vs 16 rows), so fp32 figures there are not bitwise; bf16 GEMMs were at every shape
tried, and CPU GEMMs were in fp32 and bf16.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from harness.ranks import rank_device
from reference_impl.attention.backends import pinned_sdpa_kernel
from reference_impl.attention.layer import USPAttention
from reference_impl.attention.selector import attention_backend_config
from reference_impl.forward_context import set_forward_context
from reference_impl.models.hunyuanvideo import HunyuanVideoBlockConfig, MMDoubleStreamBlock, MMSingleStreamBlock, hunyuan_rope, shard_text
from reference_impl.models.layers import even_shard_bounds
from reference_impl.models.zimage import ZImageConfig, ZImageDiT, ZImageTransformerBlock, zimage_rope
from reference_impl.parallel import comm
from reference_impl.parallel.state import destroy_sequence_parallel, get_ulysses_group, init_sequence_parallel

Tensor = torch.Tensor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Tiny architectures: heads divisible by 2 and 4 so the same worker runs at W = 1, 2, 4.
ZIMAGE_TINY = dict(dim=64, num_heads=4, num_kv_heads=4, head_dim=16, ffn_hidden_dim=128, num_layers=2, axes_dims=[4, 6, 6],
                   in_channels=4, patch_size=2, cap_feat_dim=32, adaln_embed_dim=32, t_embed_mid_dim=64, t_freq_dim=32)
HUNYUAN_TINY = dict(hidden_size=64, num_heads=4, mlp_ratio=2.0, rope_axes_dim=[4, 6, 6])


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _device(device: str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    try:
        return rank_device()
    except RuntimeError:  # a group the caller started itself
        return torch.device("cpu")


@contextmanager
def _backend(backend: str | None) -> Iterator[None]:
    with attention_backend_config({"force": backend}) if backend else nullcontext():
        yield


def _inputs(seed: int, device: torch.device, dtype: torch.dtype) -> Callable[..., Tensor]:
    """Seeded random inputs already rounded to ``dtype``, so the fp64 reference sees the very same values."""
    gen = torch.Generator().manual_seed(seed + 1)
    return lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)


def _table_dtype(model: torch.nn.Module) -> torch.dtype:
    """RoPE tables in fp32, or fp64 for the fp64 reference copy (so its only rounding is fp64's)."""
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


def _figures(out: Tensor, ref: Tensor, ref64: Tensor) -> dict[str, Any]:
    d = (out.double() - ref.double()).abs()
    return {
        "bitwise": bool(torch.equal(out, ref)),
        "finite": bool(torch.isfinite(out).all()),
        "max_abs": d.max().item(),
        "mean_abs": d.mean().item(),
        "max_abs_vs_fp64": (out.double() - ref64).abs().max().item(),
        "single_rank_max_abs_vs_fp64": (ref.double() - ref64).abs().max().item(),
        "numel": out.numel(),
    }


def _gather(t: Tensor) -> Tensor:
    """Every rank's tokens, in rank order (sharded outputs: the full sequence; replicated: W copies)."""
    return comm.all_gather(t.contiguous(), dim=1, group=get_ulysses_group())


def _reference(fn: Callable[..., Any], model: torch.nn.Module, args: tuple[Tensor, ...], sdpa_kernel: str | None) -> tuple[Any, Any]:
    """Single-rank outputs in the model's dtype (kernel pinned like the SP run) and in fp64 (a
    float64 copy of the same weights, same inputs, any kernel: the fused ones have no fp64)."""
    with pinned_sdpa_kernel(sdpa_kernel):
        low = fn(model, *args)
    high = fn(copy.deepcopy(model).double(), *(a.double() for a in args))
    return low, high


def _backend_info(attn: USPAttention, sdpa_kernel: str | None) -> dict[str, Any]:
    """Which backend ran and why, and the SDPA kernel pinned around the low-precision runs (None: torch chose)."""
    return {"backend": attn.backend.value, "backend_level": attn.selection.level,
            "sdpa_kernel": sdpa_kernel or getattr(attn.attn_impl, "kernel", None)}


def _run_worker(
    reference: Callable[[], Any], sharded: Callable[[int, int, Any], dict[str, Any]], info: dict[str, Any],
    sdpa_kernel: str | None,
) -> dict[str, Any]:
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
    return {**info, "rank": rank, "world_size": world, "paths": paths}


# ---------------------------------------------------------------------------- Z-Image
def zimage_sp_parity_worker(
    dtype_name: str = "bfloat16", seed: int = 0, *, grid_hw: tuple[int, int] = (8, 8), cap_len: int = 6, batch: int = 1,
    config: Mapping[str, Any] | None = None, backend: str | None = None, sdpa_kernel: str | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Z-Image block (caption as replicated suffix) and ZImageDiT end to end, SP=W vs one rank.

    Paths: ``block.image``, ``block.caption`` (every rank's copy), ``dit`` (the gathered
    latent prediction), all expected bitwise; and ``control.block.caption_as_prefix.image``,
    the caption rotated to the front (expected *not* bitwise: the drift order preservation
    removes). Ulysses degree = the group's world size, ring degree 1. ``config`` overrides keys
    of :data:`ZIMAGE_TINY` (e.g. real head counts for a shape sweep); ``backend`` forces the
    attention backend, ``sdpa_kernel`` pins torch's SDPA kernel for the low-precision runs.
    """
    dtype, dev = _dtype(dtype_name), _device(device)
    with _backend(backend):
        torch.manual_seed(seed)
        cfg = ZImageConfig.from_dict({**ZIMAGE_TINY, **(config or {})})
        block = ZImageTransformerBlock(cfg).to(dev, dtype)
        dit = ZImageDiT(cfg).to(dev, dtype)
    attn = block.attention.attn
    rand = _inputs(seed, dev, dtype)
    n_img = grid_hw[0] * grid_hw[1]
    img, cap = rand(batch, n_img, cfg.dim), rand(batch, cap_len, cfg.dim)
    adaln = rand(batch, cfg.adaln_embed_dim)
    p = cfg.patch_size
    latents = rand(batch, cfg.in_channels, grid_hw[0] * p, grid_hw[1] * p)
    t = rand(batch).abs()
    caption = rand(batch, cap_len, cfg.cap_feat_dim)

    def block_full(m: torch.nn.Module, img_: Tensor, cap_: Tensor, ada: Tensor) -> Tensor:
        rope = zimage_rope(cfg, grid_hw, cap_len, device=dev, dtype=_table_dtype(m))
        return m(torch.cat([img_, cap_], dim=1), rope, ada, num_replicated_suffix=cap_len)

    def reference() -> tuple[Any, Any]:
        return (_reference(block_full, block, (img, cap, adaln), sdpa_kernel),
                _reference(lambda m, *a: m(*a), dit, (latents, t, caption), sdpa_kernel))

    def sharded(rank: int, world: int, refs: tuple[Any, Any]) -> dict[str, Any]:
        (ref, ref64), (dit_ref, dit_ref64) = refs
        start, end = even_shard_bounds(n_img, rank, world)
        rope = zimage_rope(cfg, grid_hw, cap_len, rank, world, dev)
        out = block(torch.cat([img[:, start:end], cap], dim=1), rope, adaln, num_replicated_suffix=cap_len)
        out_img, out_cap = _gather(out[:, : end - start]), _gather(out[:, end - start :])
        # Control: the caption rotated to the front as a replicated *prefix* (sglang's old suffix
        # path). Same maths, another K/V scan order: shows what order preservation buys.
        rot = block(torch.cat([cap, img[:, start:end]], dim=1), (rope[0].roll(cap_len, 0), rope[1].roll(cap_len, 0)), adaln,
                    num_replicated_prefix=cap_len)
        dit_out = dit(latents, t, caption)
        return {
            "block.image": _figures(out_img, ref[:, :n_img], ref64[:, :n_img]),
            "block.caption": _figures(out_cap, ref[:, n_img:].repeat(1, world, 1), ref64[:, n_img:].repeat(1, world, 1)),
            "dit": _figures(dit_out, dit_ref, dit_ref64),
            "control.block.caption_as_prefix.image": _figures(_gather(rot[:, cap_len:]), ref[:, :n_img], ref64[:, :n_img]),
        }

    info = {"model": "zimage", "dtype": dtype_name, "seed": seed, **_backend_info(attn, sdpa_kernel)}
    return _run_worker(reference, sharded, info, sdpa_kernel)


# ---------------------------------------------------------------------------- HunyuanVideo
def hunyuan_sp_parity_worker(
    dtype_name: str = "bfloat16", seed: int = 0, *, grid_thw: tuple[int, int, int] = (2, 4, 4), txt_len: int = 7,
    batch: int = 1, config: Mapping[str, Any] | None = None, backend: str | None = None, sdpa_kernel: str | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """MMDoubleStreamBlock and MMSingleStreamBlock, SP=W vs one rank, in both text layouts.

    Paths: ``{double,single}.suffix.{image,text}`` (text replicated on every rank, as
    ``num_replicated_suffix``) and ``{double,single}.varlen.{image,text}`` (text sharded with
    :func:`shard_text`, ``seq_lens`` varlen; padded text positions are dropped). Pick a
    ``txt_len`` not divisible by W to exercise uneven per-rank lengths. ``config`` overrides
    keys of :data:`HUNYUAN_TINY`; ``backend`` / ``sdpa_kernel`` as for the Z-Image worker.
    """
    dtype, dev = _dtype(dtype_name), _device(device)
    with _backend(backend):
        torch.manual_seed(seed)
        cfg = HunyuanVideoBlockConfig.from_dict({**HUNYUAN_TINY, **(config or {})})
        double = MMDoubleStreamBlock(cfg).to(dev, dtype)
        single = MMSingleStreamBlock(cfg).to(dev, dtype)
    rand = _inputs(seed, dev, dtype)
    n_img = grid_thw[0] * grid_thw[1] * grid_thw[2]
    img, txt, vec = rand(batch, n_img, cfg.hidden_size), rand(batch, txt_len, cfg.hidden_size), rand(batch, cfg.hidden_size)

    def double_full(m: torch.nn.Module, img_: Tensor, txt_: Tensor, vec_: Tensor) -> Tensor:
        return torch.cat(m(img_, txt_, vec_, hunyuan_rope(cfg, grid_thw, device=dev, dtype=_table_dtype(m))), dim=1)

    def single_full(m: torch.nn.Module, img_: Tensor, txt_: Tensor, vec_: Tensor) -> Tensor:
        return m(torch.cat([img_, txt_], dim=1), vec_, txt_len, hunyuan_rope(cfg, grid_thw, device=dev, dtype=_table_dtype(m)))

    def reference() -> dict[str, tuple[Tensor, Tensor]]:
        return {"double": _reference(double_full, double, (img, txt, vec), sdpa_kernel),
                "single": _reference(single_full, single, (img, txt, vec), sdpa_kernel)}

    def sharded(rank: int, world: int, refs: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Any]:
        start, end = even_shard_bounds(n_img, rank, world)
        rope = hunyuan_rope(cfg, grid_thw, rank, world, dev)
        img_l = img[:, start:end]
        txt_shard, valid = shard_text(txt, rank, world)
        n_local = end - start

        def run(kind: str, txt_l: Tensor, **layout: Any) -> tuple[Tensor, Tensor]:
            if kind == "double":
                return double(img_l, txt_l, vec, rope, **layout)
            out = single(torch.cat([img_l, txt_l], dim=1), vec, txt_l.shape[1], rope, **layout)
            return out[:, :n_local], out[:, n_local:]

        paths: dict[str, Any] = {}
        for kind, (ref, ref64) in refs.items():
            ref_img, ref_txt = ref[:, :n_img], ref[:, n_img:]
            ref64_img, ref64_txt = ref64[:, :n_img], ref64[:, n_img:]
            out_img, out_txt = run(kind, txt)
            paths[f"{kind}.suffix.image"] = _figures(_gather(out_img), ref_img, ref64_img)
            paths[f"{kind}.suffix.text"] = _figures(
                _gather(out_txt), ref_txt.repeat(1, world, 1), ref64_txt.repeat(1, world, 1)
            )
            out_img, out_txt = run(kind, txt_shard, txt_is_sharded=True, txt_valid_lens=valid)
            paths[f"{kind}.varlen.image"] = _figures(_gather(out_img), ref_img, ref64_img)
            # Padding sits only at the tail of the last ranks, so the gathered chunks' first txt_len are the text.
            paths[f"{kind}.varlen.text"] = _figures(_gather(out_txt)[:, :txt_len], ref_txt, ref64_txt)
        return paths

    info = {"model": "hunyuanvideo", "dtype": dtype_name, "seed": seed, "txt_len": txt_len,
            **_backend_info(double.attn, sdpa_kernel)}
    return _run_worker(reference, sharded, info, sdpa_kernel)
