"""LinearBase and its packed variants: shard placement through weight_loader, guards, FP8 config parsing."""

from __future__ import annotations

import pytest
import torch

from reference_impl.quantization import (
    Fp8Config,
    MergedColumnLinear,
    QKVLinear,
    QuantizationConfigError,
    ReplicatedLinear,
    UnquantizedLinearMethod,
    dequantize_fp8,
    get_quantization_config,
    quantize_fp8,
    quantized_linear_layers,
)


def _load_shards(layer, tensors: dict, name: str = "weight") -> None:
    param = getattr(layer, name)
    for shard_id, tensor in tensors.items():
        param.weight_loader(param, tensor, shard_id)


def test_unquantized_qkv_places_each_shard_and_multiplies() -> None:
    layer = QKVLinear(8, 4, num_heads=2, num_kv_heads=1, bias=True, prefix="attn.qkv_proj")
    assert isinstance(layer.quant_method, UnquantizedLinearMethod) and not layer.is_quantized
    parts = {s: torch.randn(n, 8) for s, n in zip("qkv", (8, 4, 4))}
    biases = {s: torch.randn(n) for s, n in zip("qkv", (8, 4, 4))}
    _load_shards(layer, parts)
    _load_shards(layer, biases, "bias")
    assert torch.equal(layer.weight, torch.cat([parts["q"], parts["k"], parts["v"]]))
    x = torch.randn(3, 8)
    expected = x @ layer.weight.t() + torch.cat(list(biases.values()))
    torch.testing.assert_close(layer(x), expected)
    assert quantized_linear_layers(layer) == []


def test_merged_column_uses_integer_shard_ids() -> None:
    layer = MergedColumnLinear(4, [6, 6], prefix="mlp.gate_up_proj")
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    _load_shards(layer, {1: up, 0: gate})  # order of arrival does not matter
    assert torch.equal(layer.weight, torch.cat([gate, up]))


def test_weight_loader_refusals_name_the_problem() -> None:
    layer = QKVLinear(8, 4, num_heads=2, num_kv_heads=1, prefix="attn.qkv_proj")
    with pytest.raises(ValueError, match=r"attn\.qkv_proj: unknown shard_id 'x'"):
        layer.weight_loader(layer.weight, torch.zeros(4, 8), "x")
    with pytest.raises(ValueError, match=r"shape \[5, 8\] does not fit the expected \[4, 8\]"):
        layer.weight_loader(layer.weight, torch.zeros(5, 8), "k")
    with pytest.raises(ValueError, match="packed layer needs a shard_id"):
        layer.weight_loader(layer.weight, torch.zeros(16, 8))
    with pytest.raises(ValueError, match="no implicit"):
        layer.weight_loader(layer.weight, torch.zeros(4, 8, dtype=torch.float8_e4m3fn), "k")


def test_fp8_layer_refuses_float_weights_and_use_before_processing() -> None:
    layer = ReplicatedLinear(32, 16, quant_config=Fp8Config(), prefix="o_proj")
    assert layer.is_quantized and layer.weight.dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="no implicit"):
        layer.weight_loader(layer.weight, torch.zeros(16, 32))
    with pytest.raises(RuntimeError, match="o_proj: FP8 weights used before process_weights_after_loading"):
        layer(torch.zeros(1, 32))


@pytest.mark.parametrize("block", [None, (4, 8)])
def test_fp8_packed_scales_land_in_their_shard(block) -> None:
    layer = QKVLinear(16, 4, num_heads=2, num_kv_heads=1, quant_config=Fp8Config(weight_block_size=block), prefix="qkv")
    quantized = {s: quantize_fp8(torch.randn(n, 16) * (i + 1), block) for i, (s, n) in enumerate(zip("qkv", (8, 4, 4)))}
    _load_shards(layer, {s: q for s, (q, _) in quantized.items()})
    _load_shards(layer, {s: sc for s, (_, sc) in quantized.items()}, "weight_scale_inv")
    scale = layer.weight_scale_inv
    if block is None:
        assert scale.tolist() == [quantized[s][1].item() for s in "qkv"]
    else:  # q owns block rows 0-1, k row 2, v row 3
        assert torch.equal(scale[0:2], quantized["q"][1]) and torch.equal(scale[2:3], quantized["k"][1])
        assert torch.equal(scale[3:4], quantized["v"][1])
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, 16)
    dense = torch.cat([dequantize_fp8(q, sc, block) for q, sc in quantized.values()])
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dense))


def test_block_boundary_inside_a_shard_is_refused_at_construction() -> None:
    with pytest.raises(
        ValueError, match=r"qkv: FP8 block height 16 does not divide the shard boundary at output row 8"
    ):
        QKVLinear(16, 4, num_heads=2, num_kv_heads=1, quant_config=Fp8Config(weight_block_size=(16, 16)), prefix="qkv")


def test_bad_scales_are_refused_after_loading() -> None:
    layer = ReplicatedLinear(16, 16, quant_config=Fp8Config(), prefix="down_proj")
    layer.weight_loader(layer.weight, quantize_fp8(torch.randn(16, 16))[0])
    layer.weight_loader(layer.weight_scale_inv, torch.tensor(float("nan")))
    with pytest.raises(ValueError, match=r"down_proj\.weight_scale_inv holds non-finite"):
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("block", [None, (16, 32)], ids=["per-tensor", "block16x32"])
def test_quantize_fp8_keeps_the_block_max_exact_and_bounds_the_rest(block: tuple[int, int] | None) -> None:
    w = torch.randn(40, 50)
    q, scale = quantize_fp8(w, block)
    back = dequantize_fp8(q, scale, block)
    assert back.abs().max() == pytest.approx(w.abs().max().item(), rel=1e-6)
    # e4m3 keeps 3 mantissa bits: round-to-nearest error <= 2^-4 relative (normal range).
    normal = w.abs() > 2**-6 * scale.max() * 2
    assert ((back - w).abs()[normal] <= w.abs()[normal] * 2**-4 + 1e-7).all()


def test_a_block_scale_has_one_value_per_block() -> None:
    assert quantize_fp8(torch.randn(40, 50), (16, 32))[1].shape == (3, 2)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "quantization_config.weight_block_size"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "quantization_config.activation_scheme"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt"),
        (
            {"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]},
            "quantization_config.ignored_layers",
        ),
        ({"quant_method": "gptq"}, "quantization_config.quant_method"),
        ({"bits": 4}, "quantization_config.quant_method"),
    ],
)
def test_bad_quantization_config_names_the_key(config: dict, key: str) -> None:
    with pytest.raises(QuantizationConfigError) as info:
        get_quantization_config(config)
    assert info.value.key == key and key in str(info.value)


def test_fp8_config_reads_checkpoint_metadata() -> None:
    cfg = get_quantization_config(
        {"quant_method": "FP8", "weight_block_size": [128, 128], "fmt": "e4m3", "modules_to_not_convert": ["lm_head"]}
    )
    assert isinstance(cfg, Fp8Config) and cfg.weight_block_size == (128, 128)
    assert get_quantization_config({"quant_method": "fp8"}).weight_block_size is None
