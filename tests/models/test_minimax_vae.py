"""MiniMax-H3 style VAE attention: dispatch per platform/dtype, component overrides, the audio dtype contract."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.contracts.model_checks import EXPECTED_DISPATCH, judge_audio, judge_video
from harness.targets.reference.vae import audio_cast_restore, audio_default, audio_fa, video_dispatch
from reference_impl.attention.selector import attention_backend_config
from reference_impl.forward_context import set_forward_context
from reference_impl.models.layers import ModelConfigError, save_safetensors
from reference_impl.models.minimax_vae import Attention, CausalAttention, ViT3DDecoder, ViT3DDecoderConfig

pytestmark = pytest.mark.timeout(60)


def _latents(shape=(2, 4, 3, 4, 4), seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _seeded_decoder(seed: int = 0, **overrides) -> ViT3DDecoder:
    torch.manual_seed(seed)
    return ViT3DDecoder(ViT3DDecoderConfig(**overrides))


# ---------------------------------------------------------------- the decoder


def test_t_causal_is_refused_at_construction():
    with pytest.raises(ValueError, match="t_causal=True.*non-causal"):
        ViT3DDecoder(ViT3DDecoderConfig(t_causal=True))
    with pytest.raises(ValueError, match="non-causal"):
        ViT3DDecoder.from_config({"t_causal": True})


def test_bad_decoder_config_names_the_key():
    with pytest.raises(ModelConfigError, match="rope_axes_dims"):
        ViT3DDecoderConfig(hidden_size=32, num_heads=2, rope_axes_dims=(4, 4, 4))
    with pytest.raises(ModelConfigError, match="qk_norm_type"):
        ViT3DDecoderConfig(qk_norm_type="layer_norm")
    with pytest.raises(ModelConfigError, match="unknown key"):
        ViT3DDecoder.from_config({"hidden": 32})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_unpatchifies_to_frames(dtype):
    decoder = _seeded_decoder(patch_size=(2, 4, 4)).to(dtype)
    with torch.no_grad():
        frames = decoder.decode(_latents().to(dtype))
    assert frames.shape == (2, 3, 6, 16, 16)
    assert frames.dtype == dtype
    assert torch.isfinite(frames).all()


def test_decoder_is_non_causal_in_time():
    """A later latent frame changes the pixels of an earlier one: every token attends to every token."""
    decoder = _seeded_decoder()
    latents = _latents()
    later = latents.clone()
    later[:, :, -1] += 1.0
    with torch.no_grad():
        a, b = decoder.decode(latents), decoder.decode(later)
    assert not torch.equal(a[:, :, 0], b[:, :, 0])


def test_decoder_weights_round_trip_through_safetensors(tmp_path):
    decoder = _seeded_decoder(seed=1)
    path = save_safetensors(decoder, tmp_path / "vae.safetensors")
    loaded = _seeded_decoder(seed=2)
    loaded.load_weights(path)
    with torch.no_grad():
        assert torch.equal(decoder.decode(_latents()), loaded.decode(_latents()))


# ---------------------------------------------------------------- video attention dispatch


def test_qk_norm_is_affine_free_rmsnorm():
    attn = Attention(heads=2, dim_head=16, qk_norm_type="rms_norm")
    assert attn.norm_q is not None and attn.norm_q.weight is None and attn.norm_k.weight is None
    assert not [name for name in attn.state_dict() if "norm" in name]  # nothing to load
    x = torch.randn(3, 5, 2, 16) * 7.0
    rms = attn.norm_q(x).pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-4)
    with pytest.raises(ValueError, match="qk_norm_type"):
        Attention(heads=2, dim_head=16, qk_norm_type="layer_norm")


def test_dispatch_table_and_cross_branch_agreement():
    result = video_dispatch()
    problems, figures = judge_video(result)
    assert problems == [], figures
    table = result.table
    assert {key: table[key[0]][key[1]].split(":")[0] for key in EXPECTED_DISPATCH} == EXPECTED_DISPATCH, table
    # Nothing else is installed here, so the USP path on simulated CUDA runs TORCH_SDPA.
    assert table["cuda"]["bf16"] == "usp:torch_sdpa"
    assert result.agreement["fp32"].max_abs_between_branches <= 1e-5
    assert result.agreement["bf16"].max_abs_between_branches <= 1e-2


def test_video_dispatch_verdict_names_a_wrong_branch():
    """The verdict is the contract's: a branch other than the expected one fails it, by name."""
    result = video_dispatch()
    table = {platform: dict(dtypes) for platform, dtypes in result.table.items()}
    table["cuda"]["bf16"] = "sdpa"  # what a silent fallback would look like
    problems, figures = judge_video(dataclasses.replace(result, table=table))
    assert figures["mismatches"] == ["cuda/bf16: expected usp, ran sdpa"] and problems


def test_rocm_math_pin_is_decided_at_call_time(monkeypatch):
    """sglang froze the gfx95 decision at import; here the platform in force at the call decides."""
    monkeypatch.setenv("PARITY_PLATFORM", "rocm:gfx942")
    attn = Attention(heads=2, dim_head=16, qk_norm_type="rms_norm")
    x = torch.randn(1, 8, 32)
    attn(x)
    assert attn.last_dispatch == "sdpa"
    monkeypatch.setenv("PARITY_PLATFORM", "rocm:gfx950")
    attn(x)
    assert attn.last_dispatch == "sdpa-math"


def test_video_vae_component_override_applies_on_cuda(monkeypatch):
    monkeypatch.setenv("PARITY_PLATFORM", "cuda")
    latents = _latents().to(torch.bfloat16)
    with attention_backend_config("video_vae=math"):
        decoder = _seeded_decoder().to(torch.bfloat16)
    with attention_backend_config("text_encoder=math"):
        other = _seeded_decoder().to(torch.bfloat16)
    with torch.no_grad():
        decoder.decode(latents)
        other.decode(latents)
    assert decoder.attention_dispatches() == ["usp:math", "usp:math"]
    assert other.attention_dispatches() == ["usp:torch_sdpa", "usp:torch_sdpa"]
    with attention_backend_config("video_vae=fa"), pytest.raises(ValueError, match="flash-attn"):
        _seeded_decoder()


def test_usp_path_needs_the_forward_context_that_decode_sets(monkeypatch):
    monkeypatch.setenv("PARITY_PLATFORM", "cuda")
    decoder = _seeded_decoder().to(torch.bfloat16)
    latents = _latents().to(torch.bfloat16)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="forward context"):
            decoder(latents)
        assert decoder.decode(latents).shape == (2, 3, 3, 16, 16)


# ---------------------------------------------------------------- audio causal attention


def test_audio_default_is_fp32_sdpa_and_fused_backends_cast_and_restore():
    default, fa, cast = audio_default(), audio_fa(), audio_cast_restore()
    problems, figures = judge_audio(default, fa, cast)
    assert problems == [], figures
    assert default.dispatch == "usp:torch_sdpa" and default.bitwise_vs_direct_sdpa
    assert not fa.ran and fa.run is None and "flash-attn" in (fa.refused or "")  # flash-attn is not installed here
    assert cast.attention_dtypes == ["torch.bfloat16", "torch.bfloat16"] and cast.out_dtype == "torch.float32"


def test_audio_verdict_fails_an_uncast_fused_path():
    """A fused path that never cast (the attention saw fp32) fails cast_restore in the contract's verdict."""
    cast = audio_cast_restore()
    problems, _ = judge_audio(
        audio_default(), audio_fa(), dataclasses.replace(cast, attention_dtypes=["torch.float32"] * 2)
    )
    assert problems == ["check failed: cast_restore: bf16 in and out of the attention"]


@pytest.mark.parametrize(("in_dim", "out_dim", "out_features"), [(64, 8, 8), (64, 16, 16), (32, 64, 64)])
def test_audio_output_width_per_branch(in_dim, out_dim, out_features):
    """in > out: mean over heads (+ adaptive pooling when head_dim != out_dim); else heads are concatenated."""
    attn = CausalAttention(in_dim, out_dim, num_heads=4)
    assert attn(torch.randn(2, 10, in_dim)).shape == (2, 10, out_features)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_audio_attention_is_causal(monkeypatch, platform):
    monkeypatch.setenv("PARITY_PLATFORM", platform)
    torch.manual_seed(0)
    attn = CausalAttention(32, 32, num_heads=4)
    x = torch.randn(1, 12, 32)
    future = x.clone()
    future[:, 8:] += 1.0
    with torch.no_grad(), set_forward_context():
        a, b = attn(x), attn(future)
    assert attn.last_dispatch == ("usp:torch_sdpa" if platform == "cuda" else "sdpa")
    assert torch.equal(a[:, :8], b[:, :8])
    assert not torch.equal(a[:, 8:], b[:, 8:])


def test_audio_supported_set_refuses_backends_outside_it(monkeypatch):
    monkeypatch.setenv("PARITY_PLATFORM", "cuda")
    with attention_backend_config("audio_vae=math"), pytest.raises(ValueError, match="supported set"):
        CausalAttention(32, 32, num_heads=4)
    with pytest.raises(ValueError, match="in_dim 30 is not divisible"):
        CausalAttention(30, 32, num_heads=4)
