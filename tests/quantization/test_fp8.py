"""Fp8LinearMethod kernels: which one runs, and the scaled_mm path (torch._scaled_mm runs tensor- and
row-wise on the CPU too) against an exact emulation and against the dequantizing reference."""

from __future__ import annotations

import pytest
import torch

from reference_impl.quantization import Fp8Config, QKVLinear, ReplicatedLinear, dequantize_fp8, quantize_fp8
from reference_impl.quantization.fp8 import FP8_MAX

# Dynamic FP8 activations on top of FP8 weights vs the dequant reference (weights only):
# relative L2 error measured 0.023-0.030 over seeds 0-4 at K=64 (bf16 output).
ACTIVATION_QUANT_REL_L2 = 0.05


def _fp8_layer(layer, gains=(1.0, 2.0, 3.0)):
    """Load random FP8 weights (shard i scaled by gains[i]) and process the layer."""
    ids = layer.shard_ids or (None,)
    dense = []
    for i, (sid, n) in enumerate(zip(ids, layer.output_sizes)):
        q, s = quantize_fp8(torch.randn(n, layer.input_size) * gains[i], layer.quant_method.block_size)
        for param, t in ((layer.weight, q), (layer.weight_scale_inv, s)):
            param.weight_loader(param, t, sid) if sid is not None else param.weight_loader(param, t)
        dense.append(dequantize_fp8(q, s, layer.quant_method.block_size))
    layer.quant_method.process_weights_after_loading(layer)
    return layer, torch.cat(dense)


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_auto_uses_the_dequant_reference_off_cuda() -> None:
    layer, dense = _fp8_layer(ReplicatedLinear(64, 32, quant_config=Fp8Config(), prefix="o_proj"))
    x = torch.randn(4, 64)
    assert layer.quant_method.kernel_for(layer, x) == "dequant"
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dense))


def test_tensorwise_scaled_mm_equals_its_exact_emulation() -> None:
    layer, dense = _fp8_layer(ReplicatedLinear(64, 32, quant_config=Fp8Config(kernel="scaled_mm"), prefix="o_proj"))
    x = torch.randn(4, 64)
    assert layer.quant_method.kernel_for(layer, x) == "scaled_mm_tensorwise"
    xs = x.abs().max() / FP8_MAX
    emulated = (x / xs).to(torch.float8_e4m3fn).float() * xs @ dense.t()
    torch.testing.assert_close(layer(x), emulated, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_rowwise_scaled_mm_for_shards_with_different_scales(seed: int) -> None:
    torch.manual_seed(seed)
    layer, dense = _fp8_layer(QKVLinear(64, 16, 2, 1, quant_config=Fp8Config(kernel="scaled_mm"), prefix="qkv"))
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    assert layer.quant_method.kernel_for(layer, x) == "scaled_mm_rowwise"
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert _rel_l2(out, torch.nn.functional.linear(x.float(), dense)) <= ACTIVATION_QUANT_REL_L2


def test_forced_scaled_mm_says_why_it_cannot_run() -> None:
    qkv, _ = _fp8_layer(QKVLinear(64, 16, 2, 1, quant_config=Fp8Config(kernel="scaled_mm"), prefix="qkv"))
    with pytest.raises(RuntimeError, match="qkv: FP8 kernel 'scaled_mm' cannot run: row-wise .* bf16 only"):
        qkv(torch.randn(2, 64))
    odd, _ = _fp8_layer(ReplicatedLinear(24, 32, quant_config=Fp8Config(kernel="scaled_mm"), prefix="odd"))
    with pytest.raises(RuntimeError, match="divisible by 16"):
        odd(torch.randn(2, 24))
    blocks, _ = _fp8_layer(ReplicatedLinear(128, 128, quant_config=Fp8Config((128, 128), "scaled_mm"), prefix="b"))
    with pytest.raises(RuntimeError, match="only on CUDA"):
        blocks(torch.randn(2, 128, dtype=torch.bfloat16))
    small, _ = _fp8_layer(ReplicatedLinear(64, 64, quant_config=Fp8Config((32, 32), "scaled_mm"), prefix="s"))
    with pytest.raises(RuntimeError, match="needs 128x128 blocks"):
        small(torch.randn(2, 64, dtype=torch.bfloat16))


def test_unknown_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown FP8 kernel 'cutlass'"):
        Fp8Config(kernel="cutlass")
