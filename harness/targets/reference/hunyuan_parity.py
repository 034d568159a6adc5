"""The HunyuanVideo check of ``model.hunyuan_sp_parity``: its double- and single-stream blocks and its
transformer, under SP=W against one rank and float64, in the text layouts sglang uses (replicated suffix,
sharded varlen text, a key-masked joint sequence). Shared machinery: :mod:`.models`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from harness.targets.figures import ModelParity, PathFigures
from harness.targets.reference.models import (
    gathered,
    path_figures,
    pinned_backend,
    reference_outputs,
    run_device,
    run_worker,
    seeded_inputs,
    table_dtype,
    torch_dtype,
)
from reference_impl.models.hunyuanvideo import (
    HunyuanVideoBlockConfig,
    MMDoubleStreamBlock,
    MMSingleStreamBlock,
    hunyuan_rope,
    shard_text,
)
from reference_impl.models.hunyuanvideo_transformer import HunyuanVideoConfig, HunyuanVideoTransformer
from reference_impl.models.layers import even_shard_bounds
from reference_impl.models.sequences import key_mask

Tensor = torch.Tensor

HUNYUAN_TINY = dict(hidden_size=64, num_heads=4, mlp_ratio=2.0, rope_axes_dim=[4, 6, 6])
HUNYUAN_MODEL_TINY = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=4,
    attention_head_dim=16,
    num_layers=1,
    num_single_layers=1,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    text_embed_dim=32,
    pooled_projection_dim=16,
    rope_axes_dim=[4, 6, 6],
)


# long: one rank's HunyuanVideo check reads as the model runs it: build, shard, run, gather, compare each path
def hunyuan_sp_parity_worker(
    dtype_name: str = "bfloat16",
    seed: int = 0,
    *,
    grid_thw: tuple[int, int, int] = (2, 4, 4),
    txt_len: int = 7,
    batch: int = 1,
    text_lengths: tuple[int, ...] = (7, 3),
    masked_text_len: int = 16,
    config: Mapping[str, Any] | None = None,
    model_config: Mapping[str, Any] | None = None,
    backend: str | None = None,
    sdpa_kernel: str | None = None,
    device: str | None = None,
) -> ModelParity:
    """MMDoubleStreamBlock, MMSingleStreamBlock and the faithful HunyuanVideoTransformer, SP=W vs one rank.

    Block paths ``{double,single}.{layout}.{image,text}``: ``suffix`` (text replicated on every
    rank, as ``num_replicated_suffix``), ``varlen`` (text sharded with :func:`shard_text`,
    ``seq_lens``; padded text positions dropped) on ``batch`` items of ``txt_len`` tokens; and
    ``masked`` (one item per entry of ``text_lengths``, text padded to ``masked_text_len``, a
    ``[B, S]`` key mask, the joint sequence sharded contiguously; image + padded text must
    divide by W). Transformer paths on the same ``grid_thw``: ``transformer`` (unpadded text
    of ``txt_len`` tokens: the replicated suffix), ``transformer.masked`` (per-item
    ``text_lengths``: the joint masked layout) and ``transformer.varlen`` (``text_layout="sharded"``).
    Pick a ``txt_len`` not divisible by W to exercise uneven per-rank lengths. ``config``
    overrides keys of :data:`HUNYUAN_TINY`, ``model_config`` of :data:`HUNYUAN_MODEL_TINY`;
    ``backend`` / ``sdpa_kernel`` as for the Z-Image worker.
    """
    dtype, dev = torch_dtype(dtype_name), run_device(device)
    with pinned_backend(backend):
        torch.manual_seed(seed)
        cfg = HunyuanVideoBlockConfig.from_dict({**HUNYUAN_TINY, **(config or {})})
        double = MMDoubleStreamBlock(cfg, compute_dtype=dtype).to(dev, dtype)
        single = MMSingleStreamBlock(cfg, compute_dtype=dtype).to(dev, dtype)
        mcfg = HunyuanVideoConfig.from_dict({**HUNYUAN_MODEL_TINY, **(model_config or {})})
        model = HunyuanVideoTransformer(mcfg, compute_dtype=dtype).to(dev, dtype)
    rand = seeded_inputs(seed, dev, dtype)
    n_img = grid_thw[0] * grid_thw[1] * grid_thw[2]
    img, txt, vec = (
        rand(batch, n_img, cfg.hidden_size),
        rand(batch, txt_len, cfg.hidden_size),
        rand(batch, cfg.hidden_size),
    )
    n_items, masked_len = len(text_lengths), masked_text_len
    m_img, m_txt, m_vec = (
        rand(n_items, n_img, cfg.hidden_size),
        rand(n_items, masked_len, cfg.hidden_size),
        rand(n_items, cfg.hidden_size),
    )
    m_mask = key_mask([n_img + n for n in text_lengths], n_img + masked_len, dev)
    inputs = _hunyuan_model_inputs(mcfg, grid_thw, rand, [txt_len] * batch, txt_len)
    masked_inputs = _hunyuan_model_inputs(mcfg, grid_thw, rand, list(text_lengths), masked_len)

    def double_full(m: torch.nn.Module, img_: Tensor, txt_: Tensor, vec_: Tensor, *mask: Tensor) -> Tensor:
        rope = hunyuan_rope(cfg, grid_thw, device=dev, dtype=table_dtype(m))
        return torch.cat(m(img_, txt_, vec_, rope, attn_mask=mask[0] if mask else None), dim=1)

    def single_full(m: torch.nn.Module, img_: Tensor, txt_: Tensor, vec_: Tensor, *mask: Tensor) -> Tensor:
        rope = hunyuan_rope(cfg, grid_thw, device=dev, dtype=table_dtype(m))
        return m(torch.cat([img_, txt_], dim=1), vec_, txt_.shape[1], rope, attn_mask=mask[0] if mask else None)

    def transformer(m: torch.nn.Module, *args: Tensor, text_layout: str = "replicated") -> Tensor:
        return m(*args, text_layout=text_layout)

    def reference() -> dict[str, tuple[Tensor, Tensor]]:
        blocks = {"double": double_full, "single": single_full}
        refs = {
            name: reference_outputs(fn, mod, (img, txt, vec), sdpa_kernel)
            for (name, fn), mod in zip(blocks.items(), (double, single))
        }
        refs.update(
            {
                f"{name}.masked": reference_outputs(fn, mod, (m_img, m_txt, m_vec, m_mask), sdpa_kernel)
                for (name, fn), mod in zip(blocks.items(), (double, single))
            }
        )
        refs["transformer"] = reference_outputs(transformer, model, inputs, sdpa_kernel)
        refs["transformer.masked"] = reference_outputs(transformer, model, masked_inputs, sdpa_kernel)
        return refs

    def sharded(rank: int, world: int, refs: dict[str, tuple[Tensor, Tensor]]) -> dict[str, PathFigures]:
        paths = _hunyuan_block_paths(double, single, cfg, grid_thw, (img, txt, vec), refs, rank, world)
        paths.update(
            _hunyuan_masked_paths(double, single, cfg, grid_thw, (m_img, m_txt, m_vec, m_mask), refs, rank, world)
        )
        paths["transformer"] = path_figures(transformer(model, *inputs), *refs["transformer"])
        paths["transformer.varlen"] = path_figures(
            transformer(model, *inputs, text_layout="sharded"), *refs["transformer"]
        )
        paths["transformer.masked"] = path_figures(transformer(model, *masked_inputs), *refs["transformer.masked"])
        return paths

    setup = {
        "model": "hunyuanvideo",
        "dtype": dtype_name,
        "seed": seed,
        "txt_len": txt_len,
        "text_lengths": list(text_lengths),
        "masked_text_len": masked_text_len,
    }
    return run_worker(reference, sharded, double.attn.attn, setup, sdpa_kernel)


def _hunyuan_model_inputs(
    cfg: HunyuanVideoConfig,
    grid_thw: tuple[int, int, int],
    rand: Callable[..., Tensor],
    lengths: list[int],
    text_len: int,
) -> tuple[Tensor, ...]:
    """Transformer inputs: latents, t, text, its mask (item i valid on ``lengths[i]``), pooled text, guidance."""
    b, p = len(lengths), cfg.patch_size
    latents = rand(b, cfg.in_channels, grid_thw[0] * cfg.patch_size_t, grid_thw[1] * p, grid_thw[2] * p)
    mask = torch.tensor([[1] * n + [0] * (text_len - n) for n in lengths], device=latents.device)
    t, guidance = rand(b).abs() * 1000, rand(b).abs() * 1000
    return latents, t, rand(b, text_len, cfg.text_embed_dim), mask, rand(b, cfg.pooled_projection_dim), guidance


def _hunyuan_block_paths(
    double: MMDoubleStreamBlock,
    single: MMSingleStreamBlock,
    cfg: HunyuanVideoBlockConfig,
    grid_thw: tuple[int, int, int],
    inputs: tuple[Tensor, Tensor, Tensor],
    refs: Mapping[str, tuple[Tensor, Tensor]],
    rank: int,
    world: int,
) -> dict[str, PathFigures]:
    """The ``suffix`` and ``varlen`` block paths on this rank's image shard."""
    img, txt, vec = inputs
    n_img, txt_len = img.shape[1], txt.shape[1]
    start, end = even_shard_bounds(n_img, rank, world)
    rope = hunyuan_rope(cfg, grid_thw, rank, world, img.device)
    img_l = img[:, start:end]
    txt_shard, valid = shard_text(txt, rank, world)
    n_local = end - start

    def run(kind: str, txt_l: Tensor, **layout: Any) -> tuple[Tensor, Tensor]:
        if kind == "double":
            return double(img_l, txt_l, vec, rope, **layout)
        out = single(torch.cat([img_l, txt_l], dim=1), vec, txt_l.shape[1], rope, **layout)
        return out[:, :n_local], out[:, n_local:]

    paths: dict[str, PathFigures] = {}
    for kind in ("double", "single"):
        ref, ref64 = refs[kind]
        ref_img, ref_txt = ref[:, :n_img], ref[:, n_img:]
        ref64_img, ref64_txt = ref64[:, :n_img], ref64[:, n_img:]
        (img_all, img_ranks), (txt_all, txt_ranks) = map(gathered, run(kind, txt))
        paths[f"{kind}.suffix.image"] = path_figures(img_all, ref_img, ref64_img, img_ranks)
        paths[f"{kind}.suffix.text"] = path_figures(
            txt_all, ref_txt.repeat(1, world, 1), ref64_txt.repeat(1, world, 1), txt_ranks
        )
        (img_all, img_ranks), (txt_all, txt_ranks) = map(
            gathered, run(kind, txt_shard, txt_is_sharded=True, txt_valid_lens=valid)
        )
        paths[f"{kind}.varlen.image"] = path_figures(img_all, ref_img, ref64_img, img_ranks)
        # Padding sits only at the tail of the last ranks, so the gathered chunks' first txt_len are the text.
        paths[f"{kind}.varlen.text"] = path_figures(txt_all[:, :txt_len], ref_txt, ref64_txt, txt_ranks[:txt_len])
    return paths


def _hunyuan_masked_paths(
    double: MMDoubleStreamBlock,
    single: MMSingleStreamBlock,
    cfg: HunyuanVideoBlockConfig,
    grid_thw: tuple[int, int, int],
    inputs: tuple[Tensor, Tensor, Tensor, Tensor],
    refs: Mapping[str, tuple[Tensor, Tensor]],
    rank: int,
    world: int,
) -> dict[str, PathFigures]:
    """The ``masked`` block paths: a contiguous shard of the joint [image | padded text] sequence and its key mask."""
    img, txt, vec, mask = inputs
    n_img = img.shape[1]
    start, end = even_shard_bounds(n_img + txt.shape[1], rank, world)
    i0, i1 = min(start, n_img), min(end, n_img)
    img_l, txt_l, mask_l = (
        img[:, i0:i1],
        txt[:, max(start, n_img) - n_img : max(end, n_img) - n_img],
        mask[:, start:end],
    )
    cos, sin = hunyuan_rope(cfg, grid_thw, device=img.device)
    rope = (cos[i0:i1], sin[i0:i1])
    outs = {
        "double": torch.cat(double(img_l, txt_l, vec, rope, attn_mask=mask_l), dim=1),
        "single": single(torch.cat([img_l, txt_l], dim=1), vec, txt_l.shape[1], rope, attn_mask=mask_l),
    }
    paths: dict[str, PathFigures] = {}
    for kind, out in outs.items():
        full, ranks = gathered(out)
        ref, ref64 = refs[f"{kind}.masked"]
        paths[f"{kind}.masked.image"] = path_figures(full[:, :n_img], ref[:, :n_img], ref64[:, :n_img], ranks[:n_img])
        paths[f"{kind}.masked.text"] = path_figures(full[:, n_img:], ref[:, n_img:], ref64[:, n_img:], ranks[n_img:])
    return paths
