"""Z-Image attention/block/DiT: fp64 hand reference, config and weight errors, 2-rank SP parity (gloo)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.targets.reference.models import ZIMAGE_TINY, zimage_sp_parity_worker
from harness.ranks import RankPool
from reference_impl import set_forward_context
from reference_impl.models.layers import ModelConfigError, WeightLoadError, save_safetensors
from reference_impl.models.zimage import ZImageAttention, ZImageConfig, ZImageDiT, zimage_rope

# GQA (4 query heads, 2 KV heads) and a non-square grid so a swapped axis or head mapping shows.
CFG = dict(ZIMAGE_TINY, num_kv_heads=2)


def _hand_positions(grid_hw: tuple[int, int], cap_len: int) -> torch.Tensor:
    """Z-Image's layout written out by hand: image (cap_len + 1, h, w) row-major, then caption (1 + i, 0, 0)."""
    img = [(cap_len + 1, h, w) for h in range(grid_hw[0]) for w in range(grid_hw[1])]
    cap = [(1 + i, 0, 0) for i in range(cap_len)]
    return torch.tensor(img + cap, dtype=torch.float64)


def _hand_attention(mod: ZImageAttention, cfg: ZImageConfig, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """ZImageAttention in fp64 from its weights: no code shared with the model."""
    h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, s, _ = x.shape
    qkv = x.double() @ mod.qkv.weight.double().T
    q = qkv[..., : h * d].reshape(b, s, h, d)
    k = qkv[..., h * d : (h + hk) * d].reshape(b, s, hk, d)
    v = qkv[..., (h + hk) * d :].reshape(b, s, hk, d)

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + cfg.qk_norm_eps) * w.double()

    q, k = rms(q, mod.norm_q.weight), rms(k, mod.norm_k.weight)
    angles = torch.cat(
        [pos[:, a : a + 1] * cfg.rope_theta ** (-torch.arange(0, n, 2, dtype=torch.float64) / n) for a, n in enumerate(cfg.axes_dims)],
        dim=-1,
    )
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]

    def rope(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous()) * rot).flatten(-2)

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h * d)
    return out @ mod.out.weight.double().T


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_attention_matches_fp64_hand_reference(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    cfg = ZImageConfig.from_dict(CFG)
    mod = ZImageAttention(cfg)
    with torch.no_grad():  # non-trivial q/k norm weights, so forgetting one shows
        mod.norm_q.weight.uniform_(0.5, 1.5)
        mod.norm_k.weight.uniform_(0.5, 1.5)
    grid, cap_len = (2, 3), 5
    x = torch.randn(2, 6 + cap_len, cfg.dim, dtype=torch.float64)
    expected = _hand_attention(mod, cfg, x, _hand_positions(grid, cap_len))
    mod = mod.to(dtype)
    with torch.no_grad(), set_forward_context():
        rope = zimage_rope(cfg, grid, cap_len, dtype=torch.promote_types(dtype, torch.float32))
        out = mod(x.to(dtype), rope, num_replicated_suffix=cap_len)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_shard_rope_rows_are_the_global_rows() -> None:
    cfg = ZImageConfig.from_dict(CFG)
    full_cos, full_sin = zimage_rope(cfg, (4, 4), 3)
    cos1, sin1 = zimage_rope(cfg, (4, 4), 3, rank=1, world=2)
    rows = list(range(8, 16)) + list(range(16, 19))  # rank 1's image shard, then the whole caption
    assert torch.equal(cos1, full_cos[rows]) and torch.equal(sin1, full_sin[rows])
    with pytest.raises(ValueError, match="16 tokens cannot be split evenly over 3"):
        zimage_rope(cfg, (4, 4), 3, rank=0, world=3)


# ---------------------------------------------------------------------------- config and weights
@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"dimm": 64}, "dimm"),
        ({"dim": 64.0}, "dim"),
        ({"axes_dims": [4, 6, 8]}, "axes_dims"),
        ({"axes_dims": [4, 5, 7]}, "axes_dims"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"patch_size": 0}, "patch_size"),
        ({"rope_theta": "256"}, "rope_theta"),
    ],
)
def test_bad_config_names_the_key(change: dict, key: str) -> None:
    with pytest.raises(ModelConfigError) as info:
        ZImageDiT.from_config({**CFG, **change})
    assert info.value.key == key and f"'{key}'" in str(info.value)


def _dit_inputs(cfg: ZImageConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, cfg.in_channels, 8, 12, generator=gen)
    return latents, torch.tensor([0.2, 0.9]), torch.randn(2, 5, cfg.cap_feat_dim, generator=gen)


def test_dit_shapes_and_conditioning() -> None:
    torch.manual_seed(0)
    dit = ZImageDiT.from_config(CFG)
    latents, t, caption = _dit_inputs(dit.config)
    with torch.no_grad(), set_forward_context():
        out = dit(latents, t, caption)
        assert out.shape == latents.shape and out.dtype == latents.dtype and torch.isfinite(out).all()
        other_caption = caption.clone()
        other_caption[:, -1] += 1.0
        assert not torch.equal(dit(latents, t, other_caption), out)  # caption reaches image tokens
        assert not torch.equal(dit(latents, torch.tensor([0.5, 0.9]), caption)[0], out[0])  # timestep per sample
        assert torch.equal(dit(latents, torch.tensor([0.5, 0.9]), caption)[1], out[1])
        assert torch.equal(dit(latents[:1], 0.2, caption[:1]), dit(latents[:1], torch.tensor([0.2]), caption[:1]))


def test_patchify_round_trip() -> None:
    dit = ZImageDiT.from_config(CFG)
    x = torch.randn(2, 4, 6, 10)
    tokens = dit._patchify(x)
    assert tokens.shape == (2, 15, 16)
    assert torch.equal(tokens[0, 1], x[0, :, 0:2, 2:4].permute(1, 2, 0).reshape(-1))  # token (0, 1): pixels (ph, pw, c)
    assert torch.equal(dit._unpatchify(tokens, 6, 10), x)


def test_dit_input_errors() -> None:
    dit = ZImageDiT.from_config(CFG)
    latents, t, caption = _dit_inputs(dit.config)
    with torch.no_grad(), set_forward_context():
        with pytest.raises(ValueError, match="channels"):
            dit(latents[:, :3], t, caption)
        with pytest.raises(ValueError, match="patch_size=2"):
            dit(latents[..., :7], t, caption)
        with pytest.raises(ValueError, match="caption_embeds must be"):
            dit(latents, t, caption[..., :8])
    with torch.no_grad(), pytest.raises(RuntimeError, match="forward context"):
        dit(latents, t, caption)


def test_load_weights_round_trip_and_errors_name_the_tensor(tmp_path) -> None:
    torch.manual_seed(0)
    src = ZImageDiT.from_config(CFG)
    torch.manual_seed(1)
    dst = ZImageDiT.from_config(CFG)
    path = save_safetensors(src, tmp_path / "dit.safetensors")
    latents, t, caption = _dit_inputs(src.config)
    with torch.no_grad(), set_forward_context():
        assert not torch.equal(dst(latents, t, caption), src(latents, t, caption))
        dst.load_weights(path)
        assert torch.equal(dst(latents, t, caption), src(latents, t, caption))

    weights = dict(src.state_dict())
    del weights["layers.1.attention.qkv.weight"]
    with pytest.raises(WeightLoadError, match=r"missing tensors: layers\.1\.attention\.qkv\.weight"):
        dst.load_weights(weights)
    weights = dict(src.state_dict(), **{"final_layer.linear.bias": torch.zeros(5)})
    with pytest.raises(WeightLoadError, match=r"misshapen tensor final_layer\.linear\.bias: module expects \[16\], checkpoint has \[5\]"):
        dst.load_weights(weights)


# ---------------------------------------------------------------------------- 2-rank SP parity
@pytest.fixture(scope="module")
def parity() -> dict[str, list[dict]]:
    """Both ranks' figures per dtype, from one 2-rank gloo group."""
    with RankPool(2, timeout=120.0) as pool:
        return {name: pool.run(zimage_sp_parity_worker, name, 0) for name in ("float32", "bfloat16")}


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sp2_block_and_dit_are_bitwise_single_rank(parity: dict[str, list[dict]], dtype_name: str) -> None:
    ranks = parity[dtype_name]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    assert ranks[0]["paths"] == ranks[1]["paths"]  # figures are global: both ranks see everything
    paths = ranks[0]["paths"]
    assert set(paths) == {"block.image", "block.caption", "dit", "control.block.caption_as_prefix.image"}
    assert paths["block.image"]["numel"] == 64 * 64 and paths["block.caption"]["numel"] == 2 * 6 * 64
    for name in ("block.image", "block.caption", "dit"):
        fig = paths[name]
        assert fig["finite"], name
        assert fig["bitwise"], f"{name} ({dtype_name}): max_abs={fig['max_abs']:.3e} mean_abs={fig['mean_abs']:.3e}"
        # The fp64 figures are measured, not trivially zero: the comparison has resolution.
        assert fig["single_rank_max_abs_vs_fp64"] > 0


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sp2_caption_rotated_to_the_front_is_not_bitwise(parity: dict[str, list[dict]], dtype_name: str) -> None:
    """The control: same maths, caption as a replicated prefix. It drifts, so the bitwise check above has teeth.

    Measured (seeds 0-3): fp32 max abs 0.8-1.3e-6, bf16 max abs 1.6-3.1e-2 (mean 1-4e-4).
    """
    fig = parity[dtype_name][0]["paths"]["control.block.caption_as_prefix.image"]
    assert fig["finite"] and not fig["bitwise"] and fig["max_abs"] > 0
    assert fig["max_abs_vs_fp64"] <= 2 * fig["single_rank_max_abs_vs_fp64"] + 1e-6, fig  # still a correct attention
