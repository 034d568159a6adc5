"""HunyuanVideo double/single-stream blocks: fp64 hand reference, text layouts, 2-rank SP parity (gloo)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.targets.reference.models import HUNYUAN_TINY, hunyuan_sp_parity_worker
from harness.ranks import RankPool
from reference_impl import set_forward_context
from reference_impl.models.hunyuanvideo import (
    HunyuanVideoBlockConfig,
    MMDoubleStreamBlock,
    MMSingleStreamBlock,
    hunyuan_rope,
    shard_text,
)
from reference_impl.models.layers import ModelConfigError

GRID = (2, 2, 3)  # t, h, w: uneven sides so a swapped axis shows
N_IMG, TXT = 12, 5

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- fp64 hand reference (no model code)
def _ln(x: Tensor, eps: float) -> Tensor:
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def _lin(x: Tensor, layer: torch.nn.Linear) -> Tensor:
    return x @ layer.weight.double().T + layer.bias.double()


def _mods(vec: Tensor, layer: torch.nn.Linear, n: int) -> list[Tensor]:
    return [m[:, None] for m in _lin(vec * torch.sigmoid(vec), layer).chunk(n, dim=-1)]


def _gelu_tanh(x: Tensor) -> Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _rope(t: Tensor, cfg: HunyuanVideoBlockConfig) -> Tensor:
    pos = torch.tensor([(a, b, c) for a in range(GRID[0]) for b in range(GRID[1]) for c in range(GRID[2])], dtype=torch.float64)
    angles = torch.cat(
        [pos[:, i : i + 1] * cfg.rope_theta ** (-torch.arange(0, n, 2, dtype=torch.float64) / n) for i, n in enumerate(cfg.rope_axes_dim)],
        dim=-1,
    )
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous()) * rot).flatten(-2)


def _attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1]), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).flatten(2)


def _split_heads(qkv: Tensor, cfg: HunyuanVideoBlockConfig) -> tuple[Tensor, Tensor, Tensor]:
    b, s, _ = qkv.shape
    q, k, v = qkv.reshape(b, s, 3, cfg.num_heads, cfg.head_dim).unbind(2)
    return q, k, v


def _hand_double(blk: MMDoubleStreamBlock, cfg: HunyuanVideoBlockConfig, img: Tensor, txt: Tensor, vec: Tensor) -> Tensor:
    streams = [(blk.img, img), (blk.txt, txt)]
    mods = [_mods(vec, st.mod.linear, 6) for st, _ in streams]
    qkvs = []
    for i, ((st, x), m) in enumerate(zip(streams, mods)):
        q, k, v = _split_heads(_lin(_ln(x, cfg.norm_eps) * (1 + m[1]) + m[0], st.attn_qkv), cfg)
        q, k = _rms(q, st.attn_q_norm.weight, cfg.qk_norm_eps), _rms(k, st.attn_k_norm.weight, cfg.qk_norm_eps)
        if i == 0:
            q, k = _rope(q, cfg), _rope(k, cfg)
        qkvs.append((q, k, v))
    attn = _attend(*(torch.cat([a, b], dim=1) for a, b in zip(*qkvs)))
    outs = []
    for (st, x), m, a in zip(streams, mods, attn.split([img.shape[1], txt.shape[1]], dim=1)):
        x = x + m[2] * _lin(a, st.attn_proj)
        mlp = _lin(_gelu_tanh(_lin(_ln(x, cfg.norm_eps) * (1 + m[4]) + m[3], st.mlp.fc1)), st.mlp.fc2)
        outs.append(x + m[5] * mlp)
    return torch.cat(outs, dim=1)


def _hand_single(blk: MMSingleStreamBlock, cfg: HunyuanVideoBlockConfig, x: Tensor, vec: Tensor) -> Tensor:
    shift, scale, gate = _mods(vec, blk.modulation.linear, 3)
    h = _lin(_ln(x, cfg.norm_eps) * (1 + scale) + shift, blk.linear1)
    q, k, v = _split_heads(h[..., : 3 * cfg.hidden_size], cfg)
    q, k = _rms(q, blk.q_norm.weight, cfg.qk_norm_eps), _rms(k, blk.k_norm.weight, cfg.qk_norm_eps)
    q = torch.cat([_rope(q[:, :N_IMG], cfg), q[:, N_IMG:]], dim=1)
    k = torch.cat([_rope(k[:, :N_IMG], cfg), k[:, N_IMG:]], dim=1)
    out = _lin(torch.cat([_attend(q, k, v), _gelu_tanh(h[..., 3 * cfg.hidden_size :])], dim=-1), blk.linear2)
    return x + gate * out


def _randomise_norms(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)


def _inputs(cfg: HunyuanVideoBlockConfig) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(2, N_IMG, cfg.hidden_size, generator=gen, dtype=torch.float64),
            torch.randn(2, TXT, cfg.hidden_size, generator=gen, dtype=torch.float64),
            torch.randn(2, cfg.hidden_size, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_double_stream_matches_fp64_hand_reference(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    cfg = HunyuanVideoBlockConfig.from_dict(HUNYUAN_TINY)
    blk = MMDoubleStreamBlock(cfg).double()
    _randomise_norms(blk)
    img, txt, vec = _inputs(cfg)
    expected = _hand_double(blk, cfg, img, txt, vec)
    blk = blk.to(dtype)
    rope = hunyuan_rope(cfg, GRID, dtype=torch.promote_types(dtype, torch.float32))
    with torch.no_grad(), set_forward_context():
        out_img, out_txt = blk(img.to(dtype), txt.to(dtype), vec.to(dtype), rope)
    assert out_img.shape == img.shape and out_txt.shape == txt.shape
    torch.testing.assert_close(torch.cat([out_img, out_txt], dim=1).double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_single_stream_matches_fp64_hand_reference(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    cfg = HunyuanVideoBlockConfig.from_dict(HUNYUAN_TINY)
    blk = MMSingleStreamBlock(cfg).double()
    _randomise_norms(blk)
    img, txt, vec = _inputs(cfg)
    x = torch.cat([img, txt], dim=1)
    expected = _hand_single(blk, cfg, x, vec)
    blk = blk.to(dtype)
    rope = hunyuan_rope(cfg, GRID, dtype=torch.promote_types(dtype, torch.float32))
    with torch.no_grad(), set_forward_context():
        out = blk(x.to(dtype), vec.to(dtype), TXT, rope)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------- text layouts
def test_shard_text_pads_the_tail_and_counts_valid_tokens() -> None:
    txt = torch.arange(1, 8, dtype=torch.float32).view(1, 7, 1)
    shards = [shard_text(txt, r, 3) for r in range(3)]
    assert [valid for _, valid in shards] == [[3, 3, 1]] * 3
    assert [s[0, :, 0].tolist() for s, _ in shards] == [[1, 2, 3], [4, 5, 6], [7, 0, 0]]
    assert torch.equal(torch.cat([s for s, _ in shards], dim=1)[:, :7], txt)
    assert shard_text(txt, 1, 4)[1] == [2, 2, 2, 1]


@pytest.mark.parametrize("kind", ["double", "single"])
def test_varlen_text_padding_never_reaches_valid_tokens(kind: str) -> None:
    """On one rank, ``txt_is_sharded`` with garbage padding gives the unpadded result on valid tokens."""
    torch.manual_seed(0)
    cfg = HunyuanVideoBlockConfig.from_dict(HUNYUAN_TINY)
    img, txt, vec = (t.float() for t in _inputs(cfg))
    padded = torch.cat([txt, 100 * torch.randn(2, 3, cfg.hidden_size)], dim=1)
    rope = hunyuan_rope(cfg, GRID)
    with torch.no_grad(), set_forward_context():
        if kind == "double":
            blk = MMDoubleStreamBlock(cfg)
            ref = torch.cat(blk(img, txt, vec, rope), dim=1)
            out = torch.cat(blk(img, padded, vec, rope, txt_is_sharded=True, txt_valid_lens=[TXT]), dim=1)
        else:
            blk = MMSingleStreamBlock(cfg)
            ref = blk(torch.cat([img, txt], dim=1), vec, TXT, rope)
            out = blk(torch.cat([img, padded], dim=1), vec, TXT + 3, rope, txt_is_sharded=True, txt_valid_lens=[TXT])
    torch.testing.assert_close(out[:, : N_IMG + TXT], ref, rtol=1e-6, atol=1e-6)


def test_text_layout_errors() -> None:
    cfg = HunyuanVideoBlockConfig.from_dict(HUNYUAN_TINY)
    img, txt, vec = (t.float() for t in _inputs(cfg))
    rope = hunyuan_rope(cfg, GRID)
    double, single = MMDoubleStreamBlock(cfg), MMSingleStreamBlock(cfg)
    x = torch.cat([img, txt], dim=1)
    with torch.no_grad(), set_forward_context():
        with pytest.raises(ValueError, match="needs txt_valid_lens"):
            double(img, txt, vec, rope, txt_is_sharded=True)
        with pytest.raises(ValueError, match="only meaningful with txt_is_sharded"):
            double(img, txt, vec, rope, txt_valid_lens=[TXT])
        with pytest.raises(ValueError, match=r"must each be in \[0, 5\]"):
            single(x, vec, TXT, rope, txt_is_sharded=True, txt_valid_lens=[6])
        with pytest.raises(ValueError, match="txt_len=0"):
            single(x, vec, 0, rope)


@pytest.mark.parametrize(
    ("change", "key"),
    [({"hidden": 64}, "hidden"), ({"num_heads": 5}, "num_heads"), ({"rope_axes_dim": [4, 6, 4]}, "rope_axes_dim"),
     ({"mlp_ratio": "2"}, "mlp_ratio"), ({"rope_axes_dim": [4, 6, 6.0]}, "rope_axes_dim[2]")],
)
def test_bad_config_names_the_key(change: dict, key: str) -> None:
    with pytest.raises(ModelConfigError) as info:
        HunyuanVideoBlockConfig.from_dict({**HUNYUAN_TINY, **change})
    assert info.value.key == key


# ---------------------------------------------------------------------------- 2-rank SP parity
@pytest.fixture(scope="module")
def parity() -> dict[str, list[dict]]:
    """Both ranks' figures per dtype from one 2-rank gloo group; txt_len=7 gives uneven text shards (4, 3)."""
    with RankPool(2, timeout=120.0) as pool:
        return {name: pool.run(hunyuan_sp_parity_worker, name, 0) for name in ("float32", "bfloat16")}


KINDS = ("double", "single")
PARTS = ("image", "text")


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sp2_text_as_replicated_suffix_is_bitwise(parity: dict[str, list[dict]], dtype_name: str) -> None:
    ranks = parity[dtype_name]
    assert ranks[0]["paths"] == ranks[1]["paths"] and ranks[0]["txt_len"] == 7
    paths = ranks[0]["paths"]
    for name in (f"{k}.suffix.{p}" for k in KINDS for p in PARTS):
        fig = paths[name]
        assert fig["finite"], name
        assert fig["bitwise"], f"{name} ({dtype_name}): max_abs={fig['max_abs']:.3e} mean_abs={fig['mean_abs']:.3e}"


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sp2_sharded_text_varlen_within_flash_attention_rule(parity: dict[str, list[dict]], dtype_name: str) -> None:
    """The varlen path scans keys as [img_0, txt_0, img_1, txt_1]: a reordering, so bounded, not bitwise.

    FlashAttention's forward rule: |SP − fp64| ≤ 2·|single-rank low precision − fp64| + floor.
    Measured (seed 0): fp32 max abs vs one rank ~2e-7; bf16 up to 1.6e-2 (one bf16 ulp at |x| in
    [2, 4)) with a mean ~2e-5, which is why a flat bf16 abs ≤ 1e-2 bound is not used.
    """
    paths = parity[dtype_name][0]["paths"]
    floor = 1e-6
    for name in (f"{k}.varlen.{p}" for k in KINDS for p in PARTS):
        fig = paths[name]
        assert fig["finite"], name
        bound = 2 * fig["single_rank_max_abs_vs_fp64"] + floor
        assert fig["max_abs_vs_fp64"] <= bound, f"{name} ({dtype_name}): {fig}"
        assert fig["mean_abs"] <= (1e-6 if dtype_name == "float32" else 1e-3), f"{name} ({dtype_name}): {fig}"
    assert paths["double.varlen.text"]["numel"] == 7 * 64  # the padded text slot is dropped, all 7 tokens compared
