"""The reference transformers against diffusers 0.42.1 itself, in fp32 and bf16 on identical weights and inputs.

Each tiny model is built from diffusers' own config class with random weights, saved by
diffusers (``save_pretrained``: config.json + safetensors) and loaded through
``from_diffusers``; outputs must agree to 1e-5 max abs in fp32 and bit for bit in bf16 (measured
on this CPU: 0 for both) with unaligned caption/image lengths, per-item text masks and Z-Image
head dims whose half is not a multiple of 8. The RoPE tables and timestep embeddings are checked
bit for bit on their own, and controls show the inputs exercise what is claimed (a mask that is
ignored, a RoPE rounded elsewhere, a norm or a bias rounded at another point is visible).
"""

from __future__ import annotations

import copy
import json

import diffusers
import pytest
import torch
from diffusers import HunyuanVideoTransformer3DModel, ZImageTransformer2DModel
from diffusers.models.embeddings import get_timestep_embedding
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed
from diffusers.models.transformers.transformer_z_image import RopeEmbedder
from diffusers.models.transformers.transformer_z_image import TimestepEmbedder as ZImageTimestepEmbedder

from reference_impl import set_forward_context
from reference_impl.models import hunyuanvideo
from reference_impl.models.checkpoint import DIFFUSERS_WEIGHTS, SafetensorsCheckpoint
from reference_impl.models.hunyuanvideo import hunyuan_rope
from reference_impl.models.hunyuanvideo_transformer import HunyuanVideoConfig, HunyuanVideoTransformer
from reference_impl.models.layers import (
    RMSNorm,
    WeightLoadError,
    apply_rope,
    apply_rope_complex,
    grid_positions,
    timestep_embedding,
)
from reference_impl.models.zimage import ZImageConfig, zimage_rope
from reference_impl.models.zimage_transformer import ZImageTransformer

Tensor = torch.Tensor
TOL = 1e-5  # the bound; measured here: 0.0 for both transformers
# bf16: the same kernels on the same layouts as diffusers, so their noise cancels: measured 0.0 for
# both. Rounding RMSNorm once (after the weight) put Z-Image 3.3e-2 to 6.3e-2 and HunyuanVideo
# 1.6e-2 to 3.3e-2 off (1-2 bf16 ulps of outputs near 4), so no flat bound is used.
PRECISIONS = {"fp32": (torch.float32, TOL), "bf16": (torch.bfloat16, 0.0)}

Z_TINY = dict(
    in_channels=4,
    dim=64,
    n_layers=2,
    n_refiner_layers=2,
    n_heads=4,
    n_kv_heads=4,
    cap_feat_dim=24,
    axes_dims=[4, 6, 6],
    axes_lens=[1024, 64, 64],
)
H_TINY = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=4,
    attention_head_dim=16,
    num_layers=2,
    num_single_layers=2,
    num_refiner_layers=2,
    mlp_ratio=2.0,
    text_embed_dim=24,
    pooled_projection_dim=12,
    rope_axes_dim=(4, 6, 6),
)
# Image-conditioned (latent_concat: 8 channels in, 4 out), no guidance embedder, 2-frame temporal patches.
H_I2V = dict(H_TINY, in_channels=8, guidance_embeds=False, image_condition_type="latent_concat", patch_size_t=2)


def test_the_pinned_diffusers_version() -> None:
    """The figures below are measured against this release; a bump must be re-measured, not slipped in."""
    assert diffusers.__version__ == "0.42.1"


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (pad tokens and norm weights too, so none can be ignored unnoticed)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("pad_token"):
                p.copy_(noise)
            elif p.dim() >= 2:
                p.copy_(noise / p[0].numel() ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.25 * noise)
            else:
                p.copy_(0.1 * noise)


def _saved(model: torch.nn.Module, directory, seed: int, **save: str) -> SafetensorsCheckpoint:
    _randomise(model.eval(), seed)
    model.save_pretrained(directory, safe_serialization=True, **save)
    return SafetensorsCheckpoint(directory, weights_name=DIFFUSERS_WEIGHTS)


def _max_abs(want: Tensor | list[Tensor], got: Tensor | list[Tensor]) -> float:
    pairs = zip(want, got) if isinstance(want, list) else [(want, got)]
    return max((a.double() - b.double()).abs().max().item() for a, b in pairs)


def _in_precision(ref: torch.nn.Module, load, precision: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """diffusers' model cast to ``precision`` and ours loaded from its fp32 state dict at that dtype."""
    dtype = PRECISIONS[precision][0]
    return copy.deepcopy(ref).to(dtype), load(dict(ref.config), ref.state_dict(), dtype=dtype)


def _rmsnorm_rounded_once(self: RMSNorm, x: Tensor) -> Tensor:
    """The reference's RMSNorm before it followed diffusers: the weight applied in fp32, one rounding."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


# ---------------------------------------------------------------------------- Z-Image
@pytest.fixture(scope="module")
def zimage(tmp_path_factory: pytest.TempPathFactory) -> tuple[ZImageTransformer2DModel, ZImageTransformer]:
    """diffusers' model, saved in shards (with the index), and ours loaded from that directory."""
    ref = ZImageTransformer2DModel(**Z_TINY)
    ckpt = _saved(ref, tmp_path_factory.mktemp("zimage"), seed=0, max_shard_size="300KB")
    assert (ckpt.directory / ckpt.index_file).is_file()  # really sharded: the index is what was read
    return ref, ZImageTransformer.from_diffusers(ckpt.config, dict(ckpt.iter_tensors()))


Z_CASES = {
    # name: (caption lengths, latent sizes (F, H, W) per item)
    "cap20-img36": ([20], [(1, 12, 12)]),  # both unaligned: 20 -> 32, 36 -> 64 with pad tokens
    "cap32-img64-aligned": ([32], [(1, 16, 16)]),
    "cap20,40-masked": ([20, 40], [(1, 12, 12), (1, 12, 12)]),  # padded 32 / 64: a per-item mask
    "cap7,3-img36,32": ([7, 3], [(1, 12, 12), (1, 8, 16)]),  # image sizes differ: the noise refiner is masked
    "cap1-two-frames": ([1], [(2, 8, 10)]),
}


@pytest.fixture(scope="module", params=list(PRECISIONS))
def zimage_at(
    request: pytest.FixtureRequest, zimage: tuple[ZImageTransformer2DModel, ZImageTransformer]
) -> tuple[str, ZImageTransformer2DModel, ZImageTransformer]:
    return request.param, *_in_precision(zimage[0], ZImageTransformer.from_diffusers, request.param)


def _zimage_outputs(
    ref: ZImageTransformer2DModel, ours: ZImageTransformer, case: str
) -> tuple[list[Tensor], list[Tensor]]:
    lengths, sizes = Z_CASES[case]
    dtype, gen = ref.x_pad_token.dtype, torch.Generator().manual_seed(len(case))
    x = [torch.randn(ref.config.in_channels, *size, generator=gen).to(dtype) for size in sizes]
    caps = [torch.randn(n, ref.config.cap_feat_dim, generator=gen).to(dtype) for n in lengths]
    t = torch.rand(len(lengths), generator=gen)
    with torch.no_grad():
        want = ref(x, t, caps, return_dict=False)[0]
        with set_forward_context():
            got = ours(x, t, caps)
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    return want, got


@pytest.mark.parametrize("case", list(Z_CASES))
def test_zimage_matches_diffusers(
    zimage_at: tuple[str, ZImageTransformer2DModel, ZImageTransformer], case: str
) -> None:
    precision, ref, ours = zimage_at
    want, got = _zimage_outputs(ref, ours, case)
    assert _max_abs(want, got) <= PRECISIONS[precision][1], (
        f"{case} ({precision}): max abs {_max_abs(want, got):.3e} (max |ref| {max(w.abs().max() for w in want):.2f})"
    )


def test_zimage_bf16_cases_resolve_where_rmsnorm_rounds(
    zimage: tuple[ZImageTransformer2DModel, ZImageTransformer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: RMSNorm rounded once, after the weight, is 1-2 bf16 ulps off (measured 3.3e-2), so 0 above has teeth."""
    ref, ours = _in_precision(zimage[0], ZImageTransformer.from_diffusers, "bf16")
    monkeypatch.setattr(RMSNorm, "forward", _rmsnorm_rounded_once)
    assert _max_abs(*_zimage_outputs(ref, ours, "cap20-img36")) > 1e-2


# Head dims by the axes that split them; diffusers rotates by a complex64 multiply, whose
# vectorised CPU kernel (AVX2, AVX-512) rounds like four real products only where D/2 is a
# multiple of 8: a real rotation is 1 ulp off at 8, 24, 36, 40 and 72 (1.3e-6 to 1.9e-6 at the output).
Z_HEAD_DIMS = {
    8: [2, 2, 4],
    16: [4, 6, 6],
    24: [8, 8, 8],
    32: [8, 12, 12],
    36: [4, 16, 16],
    40: [8, 16, 16],
    72: [24, 24, 24],
}
VECTORISED_COMPLEX = ("AVX2", "AVX512")


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("head_dim", [8, 24, 32, 36], ids=lambda d: f"d{d}")
def test_zimage_matches_diffusers_at_head_dim(head_dim: int, precision: str) -> None:
    """Bit for bit at every head dim, the awkward ones included (a real rotation: 1.3e-6 to 1.9e-6 in fp32)."""
    base = ZImageTransformer2DModel(**dict(Z_TINY, dim=4 * head_dim, axes_dims=Z_HEAD_DIMS[head_dim]))
    _randomise(base.eval(), seed=head_dim)
    ref, ours = _in_precision(base, ZImageTransformer.from_diffusers, precision)
    assert ours.config.head_dim == head_dim
    want, got = _zimage_outputs(ref, ours, "cap20,40-masked")
    assert _max_abs(want, got) == 0, f"d{head_dim} ({precision}): max abs {_max_abs(want, got):.3e}"


@pytest.mark.parametrize("head_dim", list(Z_HEAD_DIMS), ids=lambda d: f"d{d}")
def test_a_real_rotation_is_diffusers_complex_multiply_only_where_half_the_head_dim_is_a_multiple_of_8(
    head_dim: int,
) -> None:
    """Why the reference multiplies complex numbers: the real rotation is 1 ulp off (2.4e-7 at |x| < 4) elsewhere."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in (*VECTORISED_COMPLEX, "DEFAULT"):
        pytest.skip(
            f"the complex64 kernel's rounding is measured on AVX2, AVX-512 and the scalar build, not {capability}"
        )
    cfg = ZImageConfig.from_dict({**Z_TINY, "dim": 4 * head_dim, "axes_dims": Z_HEAD_DIMS[head_dim]})
    rope = zimage_rope(cfg, grid_positions((1, 8, 8), (33, 0, 0)))
    x = torch.randn(2, 64, 4, head_dim, generator=torch.Generator().manual_seed(head_dim))
    off = (apply_rope(x, *rope) - apply_rope_complex(x, *rope)).abs().max().item()
    rounds_alike = head_dim // 2 % 8 == 0 or capability == "DEFAULT"
    assert (off == 0) if rounds_alike else (0 < off <= 2.4e-7), f"d{head_dim} on {capability}: {off:.3e}"


def test_zimage_rope_table_is_diffusers_table_bit_for_bit() -> None:
    """Up to the table ends (positions 1023 / 511), where fp64-then-round tables differ by 1.5e-5."""
    cfg = ZImageConfig.from_dict(
        {**Z_TINY, "dim": 128, "n_heads": 1, "axes_dims": [32, 48, 48], "axes_lens": [1024, 512, 512]}
    )
    pos = torch.stack([torch.arange(1024), torch.arange(1024) % 512, (7 * torch.arange(1024)) % 512], dim=-1)
    table = RopeEmbedder(cfg.rope_theta, list(cfg.axes_dims), list(cfg.axes_lens))(pos)
    cos, sin = zimage_rope(cfg, pos)
    assert torch.equal(cos, table.real) and torch.equal(sin, table.imag)
    exact = zimage_rope(cfg, pos, torch.float64)[0]
    assert (exact - table.real.double()).abs().max() > 1e-5  # the rounding this reproduces is real


def test_zimage_state_dict_round_trips_and_loading_is_strict(
    zimage: tuple[ZImageTransformer2DModel, ZImageTransformer],
) -> None:
    ref, ours = zimage
    theirs, mine = ref.state_dict(), ours.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    config = dict(ref.config)
    with pytest.raises(WeightLoadError, match=r"missing tensors: noise_refiner\.1\.attention\.to_k\.weight"):
        ZImageTransformer.from_diffusers(
            config, {k: v for k, v in theirs.items() if k != "noise_refiner.1.attention.to_k.weight"}
        )
    with pytest.raises(WeightLoadError, match=r"unexpected tensors: siglip_pad_token"):
        ZImageTransformer.from_diffusers(config, {**theirs, "siglip_pad_token": torch.zeros(1, 64)})


# ---------------------------------------------------------------------------- HunyuanVideo
@pytest.fixture(scope="module", params=["t2v", "i2v-latent-concat"])
def hunyuan(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[HunyuanVideoTransformer3DModel, HunyuanVideoTransformer]:
    """diffusers' model saved as one safetensors file, ours loaded from config.json and that file's path."""
    ref = HunyuanVideoTransformer3DModel(**(H_TINY if request.param == "t2v" else H_I2V))
    ckpt = _saved(ref, tmp_path_factory.mktemp("hunyuan"), seed=1)
    config = json.loads((ckpt.directory / "config.json").read_text())
    return ref, HunyuanVideoTransformer.from_diffusers(config, ckpt.directory / ckpt.single_file)


H_CASES = {
    # name: (valid text tokens per item, padded text length, latent token grid (t, h, w))
    "txt7-unpadded": ([7], 7, (2, 4, 6)),
    "txt7,3-per-item": ([7, 3], 9, (2, 4, 6)),
    "txt5-padded-to-12": ([5], 12, (2, 3, 5)),
    "txt8,1-odd-grid": ([8, 1], 8, (3, 5, 3)),
}


def _hunyuan_inputs(
    cfg: HunyuanVideoConfig,
    lengths: list[int],
    text_len: int,
    grid: tuple[int, int, int],
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, ...]:
    """Latents, text and pooled text in ``dtype``; timestep and guidance in fp32, as a pipeline passes them."""
    gen = torch.Generator().manual_seed(seed)
    b, p = len(lengths), cfg.patch_size
    x = torch.randn(b, cfg.in_channels, grid[0] * cfg.patch_size_t, grid[1] * p, grid[2] * p, generator=gen).to(dtype)
    mask = torch.tensor([[1] * n + [0] * (text_len - n) for n in lengths])
    text = torch.randn(b, text_len, cfg.text_embed_dim, generator=gen).to(dtype)
    pooled = torch.randn(b, cfg.pooled_projection_dim, generator=gen).to(dtype)
    t = 1000 * torch.rand(b, generator=gen)
    return x, t, text, mask, pooled, torch.full((b,), 6000.0) if cfg.guidance_embeds else None


@pytest.fixture(scope="module", params=list(PRECISIONS))
def hunyuan_at(
    request: pytest.FixtureRequest, hunyuan: tuple[HunyuanVideoTransformer3DModel, HunyuanVideoTransformer]
) -> tuple[str, HunyuanVideoTransformer3DModel, HunyuanVideoTransformer]:
    return request.param, *_in_precision(hunyuan[0], HunyuanVideoTransformer.from_diffusers, request.param)


def _hunyuan_outputs(
    ref: HunyuanVideoTransformer3DModel, ours: HunyuanVideoTransformer, case: str
) -> tuple[Tensor, Tensor]:
    inputs = _hunyuan_inputs(ours.config, *H_CASES[case], seed=len(case), dtype=ref.proj_out.weight.dtype)
    with torch.no_grad():
        want = ref(*inputs, return_dict=False)[0]
        with set_forward_context():
            got = ours(*inputs)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    return want, got


@pytest.mark.parametrize("case", list(H_CASES))
def test_hunyuan_matches_diffusers(
    hunyuan_at: tuple[str, HunyuanVideoTransformer3DModel, HunyuanVideoTransformer], case: str
) -> None:
    precision, ref, ours = hunyuan_at
    want, got = _hunyuan_outputs(ref, ours, case)
    assert _max_abs(want, got) <= PRECISIONS[precision][1], (
        f"{case} ({precision}): max abs {_max_abs(want, got):.3e} (max |ref| {want.abs().max():.2f})"
    )


def test_hunyuan_bf16_cases_resolve_where_rmsnorm_rounds(
    hunyuan: tuple[HunyuanVideoTransformer3DModel, HunyuanVideoTransformer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: RMSNorm rounded once, after the weight, is a bf16 ulp off (measured 1.6e-2 to 2.3e-2)."""
    ref, ours = _in_precision(hunyuan[0], HunyuanVideoTransformer.from_diffusers, "bf16")
    monkeypatch.setattr(RMSNorm, "forward", _rmsnorm_rounded_once)
    assert _max_abs(*_hunyuan_outputs(ref, ours, "txt7-unpadded")) > 1e-2


def test_hunyuan_bf16_batches_resolve_where_the_output_bias_is_added(
    hunyuan: tuple[HunyuanVideoTransformer3DModel, HunyuanVideoTransformer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control: diffusers adds to_out's bias after the GEMM for batches of more than one item; fusing it is off."""
    ref, ours = _in_precision(hunyuan[0], HunyuanVideoTransformer.from_diffusers, "bf16")
    monkeypatch.setattr(hunyuanvideo, "_output_projection", lambda linear, x: linear(x.contiguous()))
    assert _max_abs(*_hunyuan_outputs(ref, ours, "txt7,3-per-item")) > 1e-2
    assert _max_abs(*_hunyuan_outputs(ref, ours, "txt7-unpadded")) == 0  # one item: diffusers fuses it too


def test_hunyuan_text_mask_is_exercised(
    hunyuan: tuple[HunyuanVideoTransformer3DModel, HunyuanVideoTransformer],
) -> None:
    """Control: the same inputs with the padding unmasked are far off, so the cases above resolve the mask."""
    ref, ours = hunyuan
    x, t, text, mask, pooled, guidance = _hunyuan_inputs(ours.config, *H_CASES["txt7,3-per-item"], seed=0)
    with torch.no_grad():
        want = ref(x, t, text, mask, pooled, guidance, return_dict=False)[0]
        with set_forward_context():
            unmasked = ours(x, t, text, torch.ones_like(mask), pooled, guidance)
    assert _max_abs(want, unmasked) > 1e-2


def test_hunyuan_rope_is_diffusers_table_bit_for_bit() -> None:
    cfg = HunyuanVideoConfig.from_dict({**H_TINY, "attention_head_dim": 128, "rope_axes_dim": [16, 56, 56]})
    grid = (33, 45, 80)  # a 129-frame 720p latent
    cos, sin = HunyuanVideoRotaryPosEmbed(1, 1, list(cfg.rope_axes_dim), cfg.rope_theta)(torch.empty(1, 1, *grid))
    mine = hunyuan_rope(cfg.blocks, grid)
    assert torch.equal(mine[0], cos[:, ::2]) and torch.equal(mine[1], sin[:, ::2])
    assert torch.equal(cos[:, ::2], cos[:, 1::2])  # diffusers repeats each entry for the channel pair
    exact = hunyuan_rope(cfg.blocks, grid, dtype=torch.float64)[0]
    assert (exact - cos[:, ::2].double()).abs().max() > 1e-6  # fp32 angles: the rounding this reproduces is real


def test_timestep_embedding_is_both_models_bit_for_bit() -> None:
    t = torch.tensor([0.0, 1.0, 17.25, 999.0, 6000.0])
    assert torch.equal(
        timestep_embedding(t, 256), get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
    )
    assert torch.equal(timestep_embedding(t, 256), ZImageTimestepEmbedder.timestep_embedding(t, 256))


def test_hunyuan_state_dict_round_trips_and_loading_is_strict(
    hunyuan: tuple[HunyuanVideoTransformer3DModel, HunyuanVideoTransformer],
) -> None:
    ref, ours = hunyuan
    theirs, mine = ref.state_dict(), ours.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    name = "single_transformer_blocks.1.attn.norm_k.weight"
    with pytest.raises(WeightLoadError, match=f"missing tensors: {name}"):
        HunyuanVideoTransformer.from_diffusers(dict(ref.config), {k: v for k, v in theirs.items() if k != name})
    bad = dict(theirs, **{"proj_out.bias": torch.zeros(3)})
    with pytest.raises(WeightLoadError, match=r"misshapen tensor proj_out\.bias"):
        HunyuanVideoTransformer.from_diffusers(dict(ref.config), bad)
