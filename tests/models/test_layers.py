"""Shared model building blocks: config validation, RMSNorm, RoPE, sharding, safetensors loading."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from reference_impl.models.layers import (
    ModelConfig,
    ModelConfigError,
    RMSNorm,
    WeightLoadError,
    apply_rope,
    axial_rope_cos_sin,
    build_and_load,
    even_shard_bounds,
    grid_positions,
    load_safetensors_into,
    read_safetensors,
    rope_cos_sin,
    save_safetensors,
    timestep_embedding,
)


@dataclass(frozen=True)
class _Cfg(ModelConfig):
    width: int
    eps: float = 1e-6
    flag: bool = False
    name: str = "x"
    dims: tuple[int, ...] = (2, 2)
    extra: int | None = None

    def validate(self) -> None:
        if self.width <= 0:
            raise self.error("width", "must be positive")


# ---------------------------------------------------------------------------- config
def test_config_from_dict_coerces_and_round_trips() -> None:
    cfg = _Cfg.from_dict({"width": 4, "eps": 1, "dims": [4, 6], "extra": None})
    assert cfg.eps == 1.0 and isinstance(cfg.eps, float)
    assert cfg.dims == (4, 6)
    assert _Cfg.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"width": 4, "bogus": 1}, "bogus"),
        ({"eps": 1e-5}, "width"),  # required key missing
        ({"width": "4"}, "width"),
        ({"width": True}, "width"),  # a bool is not an int
        ({"width": 4, "eps": "small"}, "eps"),
        ({"width": 4, "flag": 1}, "flag"),
        ({"width": 4, "name": 3}, "name"),
        ({"width": 4, "dims": 8}, "dims"),
        ({"width": 4, "dims": [2, 2.5]}, "dims[1]"),
        ({"width": 4, "extra": 1.5}, "extra"),
        ({"width": 0}, "width"),  # the subclass's own validate()
    ],
)
def test_config_errors_name_the_key(data: dict, key: str) -> None:
    with pytest.raises(ModelConfigError, match=re.escape(f"'{key}'")) as info:
        _Cfg.from_dict(data)
    assert info.value.key == key


def test_config_refuses_a_non_mapping() -> None:
    with pytest.raises(ModelConfigError, match="mapping"):
        _Cfg.from_dict([("width", 4)])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- RMSNorm
def test_rmsnorm_affine_free_has_no_parameters_and_matches_unit_weight() -> None:
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    free, affine = RMSNorm(8, eps=1e-6, elementwise_affine=False), RMSNorm(8, eps=1e-6)
    assert list(free.parameters()) == [] and free.state_dict() == {}
    assert torch.equal(free(x), affine(x))  # affine weight starts at ones
    with torch.no_grad():
        affine.weight.copy_(torch.linspace(-2, 2, 8, dtype=torch.float64))
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * affine.weight
    torch.testing.assert_close(affine.double()(x), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(free(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), rtol=1e-12, atol=1e-12)


def test_rmsnorm_keeps_dtype_and_refuses_wrong_width() -> None:
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    y = RMSNorm(8).to(torch.bfloat16)(x)
    assert y.dtype == torch.bfloat16
    expected = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(y, expected)  # computed in fp32, rounded once
    with pytest.raises(ValueError, match="RMSNorm\\(8\\)"):
        RMSNorm(8)(torch.randn(2, 6))


def test_from_diffusers_drops_bookkeeping_keys_and_checks_the_rest() -> None:
    saved = {"_class_name": "X", "_diffusers_version": "0.42.1", "width": 4}
    assert _Cfg.from_diffusers(saved) == _Cfg(width=4)
    with pytest.raises(ModelConfigError, match="'bogus'"):
        _Cfg.from_diffusers({**saved, "bogus": 1})


# ---------------------------------------------------------------------------- RoPE
def _complex_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Independent interleaved RoPE: channel pairs (2i, 2i+1) as complex numbers times e^{i·angle}."""
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    return torch.view_as_real(xc * rot).flatten(-2)


def test_rope_matches_complex_rotation_and_is_relative() -> None:
    dim, theta = 8, 10000.0
    pos = torch.tensor([0, 1, 5, 17])
    cos, sin = rope_cos_sin(pos, dim, theta)
    inv = torch.tensor([theta ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)
    angles = pos.double()[:, None] * inv[None]
    assert torch.equal(cos[0], torch.ones(dim // 2)) and torch.equal(sin[0], torch.zeros(dim // 2))
    x = torch.randn(2, 4, 3, dim, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin), _complex_rope(x, angles), rtol=1e-6, atol=1e-6)
    # <R(p) q, R(p') k> depends only on p - p': shift both positions by the same amount.
    q, k = torch.randn(1, 1, 1, dim, dtype=torch.float64), torch.randn(1, 1, 1, dim, dtype=torch.float64)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([pq]), dim, theta)
        ck, sk = rope_cos_sin(torch.tensor([pk]), dim, theta)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert score(3, 1) == pytest.approx(score(10, 8), abs=1e-6)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)


def test_rope_neox_layout_is_a_channel_permutation_of_interleaved() -> None:
    dim = 8
    cos, sin = rope_cos_sin(torch.arange(5), dim)
    x = torch.randn(1, 5, 2, dim)
    perm = torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])  # interleaved → halves
    torch.testing.assert_close(
        apply_rope(x[..., perm], cos, sin, interleaved=False), apply_rope(x, cos, sin)[..., perm]
    )


def test_rope_batched_tables_and_shape_errors() -> None:
    cos, sin = rope_cos_sin(torch.arange(4), 8)
    x = torch.randn(2, 4, 3, 8)
    assert torch.equal(apply_rope(x, cos.expand(2, 4, 4), sin.expand(2, 4, 4)), apply_rope(x, cos, sin))
    with pytest.raises(ValueError, match="do not fit"):
        apply_rope(torch.randn(2, 5, 3, 8), cos, sin)
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(torch.arange(4), 7)


def test_rope_rounding_is_where_the_table_is_rounded() -> None:
    pos = torch.arange(1024)
    exact = rope_cos_sin(pos, 32, 256.0, torch.float64)
    fp64 = rope_cos_sin(pos, 32, 256.0)
    assert torch.equal(fp64[0], exact[0].float()) and torch.equal(fp64[1], exact[1].float())  # rounded once
    inv = 1.0 / 256.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    angles = torch.outer(pos.double(), inv).float()
    polar = torch.polar(torch.ones_like(angles), angles)
    assert torch.equal(rope_cos_sin(pos, 32, 256.0, rounding="fp32_angles")[0], polar.real)
    angles32 = torch.outer(pos.float(), 1.0 / 256.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    assert torch.equal(rope_cos_sin(pos, 32, 256.0, rounding="fp32")[1], angles32.sin())
    with pytest.raises(ValueError, match="unknown RoPE rounding 'bf16'"):
        rope_cos_sin(pos, 32, rounding="bf16")


@pytest.mark.parametrize("rounding", ["fp32_angles", "fp32"])
def test_a_rope_rounding_differs_from_the_exact_table_and_fp64_ignores_it(rounding: str) -> None:
    pos = torch.arange(1024)
    exact = rope_cos_sin(pos, 32, 256.0, torch.float64)
    assert (rope_cos_sin(pos, 32, 256.0, rounding=rounding)[0].double() - exact[0]).abs().max() > 1e-6
    assert torch.equal(rope_cos_sin(pos, 32, 256.0, torch.float64, rounding)[0], exact[0])


def test_timestep_embedding_is_cos_then_sin() -> None:
    t = torch.tensor([0.0, 3.0])
    emb = timestep_embedding(t, 8)
    freqs = torch.tensor([10000 ** (-i / 4) for i in range(4)])
    torch.testing.assert_close(emb, torch.cat([(t[:, None] * freqs).cos(), (t[:, None] * freqs).sin()], dim=-1))
    with pytest.raises(ValueError, match="even"):
        timestep_embedding(t, 7)


def test_axial_rope_positions_and_shape() -> None:
    pos = grid_positions((2, 3, 4), offsets=(7, 0, 0))
    assert pos.shape == (24, 3)
    assert pos[0].tolist() == [7, 0, 0] and pos[1].tolist() == [7, 0, 1] and pos[4].tolist() == [7, 1, 0]
    cos, _ = axial_rope_cos_sin(pos, (4, 2, 6), theta=256.0)
    assert cos.shape == (24, 6)
    with pytest.raises(ValueError, match="positions must be"):
        axial_rope_cos_sin(pos[:, :2], (4, 2, 6))


@pytest.mark.parametrize(("axis", "lo", "hi", "d"), [(0, 0, 2, 4), (1, 2, 3, 2), (2, 3, 6, 6)], ids=["t", "h", "w"])
def test_axial_rope_is_per_axis_rope_concatenated(axis: int, lo: int, hi: int, d: int) -> None:
    pos = grid_positions((2, 3, 4), offsets=(7, 0, 0))
    cos, sin = axial_rope_cos_sin(pos, (4, 2, 6), theta=256.0)
    c, s = rope_cos_sin(pos[:, axis], d, 256.0)
    assert torch.equal(cos[:, lo:hi], c) and torch.equal(sin[:, lo:hi], s)


def test_even_shard_bounds_cover_the_sequence_in_order() -> None:
    assert [even_shard_bounds(12, r, 3) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="13 tokens"):
        even_shard_bounds(13, 0, 2)


# ---------------------------------------------------------------------------- safetensors
class _Net(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 3)
        self.norm = RMSNorm(3)
        self.free = RMSNorm(3, elementwise_affine=False)


def test_save_then_load_round_trips(tmp_path) -> None:
    torch.manual_seed(0)
    src, dst = _Net(), _Net()
    path = save_safetensors(src, tmp_path / "w.safetensors")
    loaded = load_safetensors_into(dst, path)
    assert sorted(loaded) == ["norm.weight", "proj.bias", "proj.weight"]
    torch.testing.assert_close(dst.state_dict(), src.state_dict(), rtol=0, atol=0)  # every tensor, bit for bit


def test_load_casts_to_the_module_dtype() -> None:
    dst = _Net().to(torch.bfloat16)
    weights = {k: torch.full_like(v, 0.5, dtype=torch.float32) for k, v in _Net().state_dict().items()}
    load_safetensors_into(dst, weights)
    assert dst.proj.weight.dtype == torch.bfloat16 and torch.all(dst.proj.weight == 0.5)


def test_load_reports_every_problem_by_name_and_copies_nothing(tmp_path) -> None:
    dst = _Net()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    bad = {"proj.weight": torch.zeros(3, 5), "proj.bias": torch.zeros(3), "stray.weight": torch.zeros(1)}
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightLoadError) as info:
        load_safetensors_into(dst, tmp_path / "bad.safetensors")
    err = info.value
    assert err.missing == ["norm.weight"] and err.unexpected == ["stray.weight"]
    assert err.mismatched == [("proj.weight", (3, 4), (3, 5))]
    text = str(err)
    assert "bad.safetensors" in text and "norm.weight" in text and "stray.weight" in text and "[3, 4]" in text
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in before.items())


def test_build_and_load_fills_every_tensor_without_initialising() -> None:
    torch.manual_seed(0)
    src = _Net()
    built = build_and_load(_Net, src.state_dict(), torch.bfloat16)
    assert built.proj.weight.device.type == "cpu" and built.proj.weight.dtype == torch.bfloat16
    assert torch.equal(built.proj.weight, src.proj.weight.bfloat16()) and torch.equal(
        built.norm.weight, src.norm.weight.bfloat16()
    )
    with pytest.raises(WeightLoadError, match="missing tensors: norm.weight"):
        build_and_load(_Net, {k: v for k, v in src.state_dict().items() if k != "norm.weight"})


def test_load_non_strict_ignores_extras_and_key_map_renames() -> None:
    dst = _Net()
    weights = {f"model.{k}": torch.ones_like(v) for k, v in dst.state_dict().items()}
    weights["model.rotary.inv_freq"] = torch.ones(2)
    rename = lambda k: k.removeprefix("model.")  # noqa: E731
    with pytest.raises(WeightLoadError, match="rotary.inv_freq"):
        load_safetensors_into(dst, weights, key_map=rename)
    load_safetensors_into(dst, weights, key_map=rename, strict=False)
    assert torch.all(dst.proj.weight == 1)
    drop = lambda k: None if "rotary" in k else k.removeprefix("model.")  # noqa: E731
    load_safetensors_into(dst, weights, key_map=drop)


def test_unreadable_files_are_named_and_pickles_are_never_loaded(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        read_safetensors(tmp_path / "nope.safetensors")
    pickled = tmp_path / "model.bin"
    torch.save(_Net().state_dict(), pickled)
    with pytest.raises(WeightLoadError, match="model.bin.*not a readable safetensors file"):
        load_safetensors_into(_Net(), pickled)
