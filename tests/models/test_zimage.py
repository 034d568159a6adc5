"""Z-Image attention and transformer: fp64 hand reference, padding and positions, config and weight errors,
2-rank SP parity (gloo). Fidelity against diffusers itself is in test_diffusers_fidelity."""

from __future__ import annotations

import math

import pytest
import torch

from harness.ranks import RankPool
from harness.targets.figures import ModelParity
from harness.targets.reference.models import ZIMAGE_TINY, zimage_sp_parity_worker
from reference_impl import set_forward_context
from reference_impl.models.layers import ModelConfigError, WeightLoadError, save_safetensors
from reference_impl.models.zimage import QK_NORM_EPS, ZImageAttention, ZImageConfig, zimage_rope
from reference_impl.models.zimage_transformer import (
    ZImageTransformer,
    caption_positions,
    image_positions,
    padded_length,
)

CFG = ZIMAGE_TINY


def _hand_attention(mod: ZImageAttention, cfg: ZImageConfig, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """ZImageAttention in fp64 from its weights: no code shared with the model."""
    h, d = cfg.n_heads, cfg.head_dim
    b, s, _ = x.shape
    q, k, v = ((x.double() @ lin.weight.double().T).reshape(b, s, h, d) for lin in (mod.to_q, mod.to_k, mod.to_v))

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + QK_NORM_EPS) * w.double()

    q, k = rms(q, mod.norm_q.weight), rms(k, mod.norm_k.weight)
    angles = torch.cat(
        [
            pos[:, a : a + 1] * cfg.rope_theta ** (-torch.arange(0, n, 2, dtype=torch.float64) / n)
            for a, n in enumerate(cfg.axes_dims)
        ],
        dim=-1,
    )
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]

    def rope(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous()) * rot).flatten(-2)

    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", rope(q), rope(k)) / math.sqrt(d), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h * d)
    return out @ mod.to_out[0].weight.double().T


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_attention_matches_fp64_hand_reference(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    cfg = ZImageConfig.from_dict(CFG)
    mod = ZImageAttention(cfg)
    with torch.no_grad():  # non-trivial q/k norm weights, so forgetting one shows
        mod.norm_q.weight.uniform_(0.5, 1.5)
        mod.norm_k.weight.uniform_(0.5, 1.5)
    pos = torch.cat([image_positions((1, 2, 3), 32)[:6], caption_positions(32)[:5]])  # 6 image + 5 caption tokens
    x = torch.randn(2, pos.shape[0], cfg.dim, dtype=torch.float64)
    expected = _hand_attention(mod, cfg, x, pos.double())
    mod = mod.to(dtype)
    with torch.no_grad(), set_forward_context():
        out = mod(x.to(dtype), zimage_rope(cfg, pos, torch.promote_types(dtype, torch.float32)))
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------- padding and positions
def test_padding_and_positions_follow_diffusers() -> None:
    assert [padded_length(n) for n in (1, 20, 32, 33, 36)] == [32, 32, 32, 64, 64]
    cap = caption_positions(32)
    assert cap[0].tolist() == [1, 0, 0] and cap[31].tolist() == [32, 0, 0]  # pad tokens continue the count
    img = image_positions((2, 2, 3), 32)  # 12 tokens, padded to 32
    assert img.shape == (32, 3)
    assert img[0].tolist() == [33, 0, 0] and img[3].tolist() == [33, 1, 0] and img[6].tolist() == [34, 0, 0]
    assert img[12:].eq(0).all()  # pad tokens sit at (0, 0, 0)


def test_rope_positions_past_the_table_are_refused() -> None:
    cfg = ZImageConfig.from_dict(CFG)  # axes_lens [1024, 64, 64]
    with pytest.raises(ValueError, match=r"position 64 on axis 1 is past axes_lens\[1\]=64"):
        zimage_rope(cfg, torch.tensor([[1, 64, 0]]))


# ---------------------------------------------------------------------------- config and weights
@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"dimm": 64}, "dimm"),
        ({"dim": 64.0}, "dim"),
        ({"axes_dims": [4, 6, 8]}, "axes_dims"),
        ({"axes_dims": [4, 5, 7]}, "axes_dims"),
        ({"n_heads": 3}, "n_heads"),
        ({"siglip_feat_dim": 32}, "siglip_feat_dim"),
        ({"all_f_patch_size": [1, 1]}, "all_f_patch_size"),
        ({"rope_theta": "256"}, "rope_theta"),
    ],
)
def test_bad_config_names_the_key(change: dict, key: str) -> None:
    with pytest.raises(ModelConfigError) as info:
        ZImageConfig.from_diffusers({**CFG, **change})
    assert info.value.key == key and f"'{key}'" in str(info.value)


def test_diffusers_bookkeeping_keys_are_dropped() -> None:
    saved = {
        "_class_name": "ZImageTransformer2DModel",
        "_diffusers_version": "0.42.1",
        "_use_default_values": ["t_scale"],
        **CFG,
    }
    assert ZImageConfig.from_diffusers(saved) == ZImageConfig.from_dict(CFG)
    assert ZImageConfig().head_dim == 128 and ZImageConfig().ffn_hidden_dim == 10240  # the released 6B sizes


def _model(seed: int = 0) -> ZImageTransformer:
    torch.manual_seed(seed)
    model = ZImageTransformer(ZImageConfig.from_dict(CFG))
    with torch.no_grad():
        model.x_pad_token.normal_()
        model.cap_pad_token.normal_()
    return model


def _inputs(lengths: list[int], sizes: list[tuple[int, int]], seed: int = 1) -> tuple[list, torch.Tensor, list]:
    gen = torch.Generator().manual_seed(seed)
    x = [torch.randn(4, 1, h, w, generator=gen) for h, w in sizes]
    caps = [torch.randn(n, CFG["cap_feat_dim"], generator=gen) for n in lengths]
    return x, torch.rand(len(lengths), generator=gen), caps


def test_transformer_shapes_and_conditioning() -> None:
    model = _model()
    x, t, caps = _inputs([20, 20], [(12, 12), (12, 12)])
    with torch.no_grad(), set_forward_context():
        out = model(x, t, caps)
        assert [o.shape for o in out] == [xi.shape for xi in x] and all(torch.isfinite(o).all() for o in out)
        other = [c.clone() for c in caps]
        other[0][-1] += 1.0
        assert not torch.equal(model(x, t, other)[0], out[0])  # the caption reaches the image
        assert torch.equal(model(x, t, other)[1], out[1])  # and only its own item's
        assert not torch.equal(model(x, torch.tensor([0.5, t[1]]), caps)[0], out[0])  # timestep per item


def test_pad_tokens_are_attended_and_per_item_masks_isolate_items() -> None:
    model = _model()
    x, t, caps = _inputs([20, 40], [(12, 12), (12, 12)])  # padded 32 and 64: the unified sequence is masked
    with torch.no_grad(), set_forward_context():
        batched = model(x, t, caps)
        alone = model(x[:1], t[:1], caps[:1])
        torch.testing.assert_close(batched[0], alone[0], rtol=1e-6, atol=1e-6)
        model.cap_pad_token.add_(1.0)  # 20 caption tokens: 12 learned pads take part in the attention
        assert not torch.equal(model(x[:1], t[:1], caps[:1])[0], alone[0])


def test_patchify_round_trip() -> None:
    model = _model()
    x = torch.randn(4, 2, 6, 10)
    tokens, grid = model._patchify(x, 2, 1)
    assert tokens.shape == (30, 16) and grid == (2, 3, 5)
    assert torch.equal(tokens[1], x[:, 0, 0:2, 2:4].permute(1, 2, 0).reshape(-1))  # token (0, 0, 1): pixels (ph, pw, c)
    assert torch.equal(model._unpatchify(tokens, (2, 6, 10), 2, 1), x)


def test_input_errors() -> None:
    model = _model()
    x, t, caps = _inputs([5], [(8, 12)])
    with torch.no_grad(), set_forward_context():
        with pytest.raises(ValueError, match=r"must be \[4, F, H, W\]"):
            model([x[0][:3]], t, caps)
        with pytest.raises(ValueError, match="H, W by 2"):
            model([x[0][..., :7]], t, caps)
        with pytest.raises(ValueError, match=r"caption 0 .* must be \[L >= 1, 32\]"):
            model(x, t, [caps[0][:, :8]])
        with pytest.raises(ValueError, match="one caption per latent"):
            model(x, t, caps * 2)
        with pytest.raises(ValueError, match="patch size 1-1"):
            model(x, t, caps, patch_size=1)
    with torch.no_grad(), pytest.raises(RuntimeError, match="forward context"):
        model(x, t, caps)


def test_load_weights_round_trip_and_errors_name_the_tensor(tmp_path) -> None:
    src, dst = _model(0), _model(1)
    path = save_safetensors(src, tmp_path / "dit.safetensors")
    x, t, caps = _inputs([5], [(8, 12)])
    with torch.no_grad(), set_forward_context():
        assert not torch.equal(dst(x, t, caps)[0], src(x, t, caps)[0])
        dst.load_weights(path)
        assert torch.equal(dst(x, t, caps)[0], src(x, t, caps)[0])
        loaded = ZImageTransformer.from_diffusers(CFG, path)
        assert torch.equal(loaded(x, t, caps)[0], src(x, t, caps)[0])

    weights = dict(src.state_dict())
    del weights["layers.1.attention.to_q.weight"]
    with pytest.raises(WeightLoadError, match=r"missing tensors: layers\.1\.attention\.to_q\.weight"):
        dst.load_weights(weights)
    weights = dict(src.state_dict(), **{"all_final_layer.2-1.linear.bias": torch.zeros(5)})
    with pytest.raises(
        WeightLoadError, match=r"misshapen tensor all_final_layer\.2-1\.linear\.bias: module expects \[16\]"
    ):
        dst.load_weights(weights)


# ---------------------------------------------------------------------------- 2-rank SP parity
@pytest.fixture(scope="module")
def parity() -> dict[str, list[ModelParity]]:
    """Both ranks' figures per dtype, from one 2-rank gloo group."""
    with RankPool(2, timeout=120.0) as pool:
        return {name: pool.run(zimage_sp_parity_worker, name, 0) for name in ("float32", "bfloat16")}


JUDGED = ("block.image", "block.caption", "transformer", "transformer.masked")


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sp2_figures_cover_every_path_on_both_ranks(parity: dict[str, list[ModelParity]], dtype_name: str) -> None:
    ranks = parity[dtype_name]
    assert [r.rank for r in ranks] == [0, 1] and all(r.world_size == 2 for r in ranks)
    assert ranks[0].paths == ranks[1].paths  # figures are global: both ranks see everything
    paths = ranks[0].paths
    assert set(paths) == {*JUDGED, "control.block.caption_as_prefix.image"}
    assert paths["block.image"].numel == 64 * 64 and paths["block.caption"].numel == 2 * 6 * 64
    assert paths["transformer.masked"].numel == 2 * 4 * 12 * 12


@pytest.mark.parametrize("name", JUDGED)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sp2_block_and_transformer_are_bitwise_single_rank(
    parity: dict[str, list[ModelParity]], dtype_name: str, name: str
) -> None:
    """Replicated-suffix caption (items of one length) and the masked unified sequence (per-item lengths)."""
    fig = parity[dtype_name][0].paths[name]
    assert fig.finite
    assert fig.bitwise, f"max_abs={fig.max_abs:.3e} mean_abs={fig.mean_abs:.3e}"
    # The fp64 figures are measured, not trivially zero: the comparison has resolution.
    assert fig.single_rank_max_abs_vs_fp64 > 0


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sp2_caption_rotated_to_the_front_is_not_bitwise(parity: dict[str, list[ModelParity]], dtype_name: str) -> None:
    """The control: same maths, caption as a replicated prefix. It drifts, so the bitwise check above has teeth.

    Measured (seed 0): fp32 max abs 1.4e-6, bf16 1.6e-2.
    """
    fig = parity[dtype_name][0].paths["control.block.caption_as_prefix.image"]
    assert fig.finite and not fig.bitwise and fig.max_abs > 0
    assert fig.max_abs_vs_fp64 <= 2 * fig.single_rank_max_abs_vs_fp64 + 1e-6, fig  # still a correct attention
