"""FP8 linear on CUDA: the ``scaled_mm`` kernels against the CPU dequantizing reference.

    python benchmarks/fp8_scaled_mm.py [--tokens 1024] [--reps 20]

At Qwen3-4B projection shapes (hidden 2560, 32 heads, 8 KV heads, head dim 128, intermediate 9728), per weight
layout (per tensor: tensor-wise ``torch._scaled_mm``; fused q/k/v of different scales: row-wise; 128x128 blocks:
``torch.nn.functional.scaled_mm``), it prints the kernel that ran, the relative L2 error of GPU ``scaled_mm`` and
``dequant`` against the CPU reference (fp32 ``F.linear`` on the dequantized weights: exact for these weights) and
median times of both and of plain bf16 ``F.linear``. Exits 1 if a ``scaled_mm`` error exceeds the bound, else 0
(also without CUDA, saying so).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the checkout's root

from benchmarks.cuda_timing import cuda_median_ms  # noqa: E402
from reference_impl.quantization import Fp8Config, LinearBase, QKVLinear, ReplicatedLinear, dequantize_fp8, quantize_fp8

# Dynamic FP8 activations (e4m3: 3 mantissa bits) against exact math on the same FP8 weights:
# about 2-3% relative L2 for Gaussian activations (CPU measurement at K=64, tests/quantization).
SCALED_MM_REL_L2_BOUND = 0.05
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 2560, 32, 8, 128, 9728


def _build(kind: str, block: tuple[int, int] | None) -> tuple[LinearBase, torch.Tensor]:
    """A processed FP8 layer on CUDA and its dequantized fp32 weight (on the CPU)."""
    config = Fp8Config(weight_block_size=block)
    if kind == "qkv":
        layer: LinearBase = QKVLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, quant_config=config, prefix="qkv_proj")
    else:
        layer = ReplicatedLinear(INTERMEDIATE, HIDDEN, quant_config=config, prefix="down_proj")
    gen = torch.Generator().manual_seed(0)
    dense = []
    for i, (sid, n) in enumerate(zip(layer.shard_ids or (None,), layer.output_sizes)):
        q, s = quantize_fp8(torch.randn(n, layer.input_size, generator=gen) * (i + 1) / layer.input_size**0.5, block)
        for param, t in ((layer.weight, q), (layer.weight_scale_inv, s)):
            param.weight_loader(param, t, sid) if sid is not None else param.weight_loader(param, t)
        dense.append(dequantize_fp8(q, s, block))
    layer.quant_method.process_weights_after_loading(layer)
    return layer.cuda(), torch.cat(dense)


def _rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref.double()).norm() / ref.double().norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("CUDA unavailable: nothing to measure here (the CPU dequant reference is covered by tests/quantization)")
        return 0
    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()} "
        f"sm{''.join(map(str, torch.cuda.get_device_capability()))}; tokens={args.tokens}"
    )
    failed = False
    cases = [
        ("down_proj", "down", None),
        ("qkv_proj", "qkv", None),
        ("qkv_proj", "qkv", (128, 128)),
        ("down_proj", "down", (128, 128)),
    ]
    for name, kind, block in cases:
        layer, dense = _build(kind, block)
        x_cpu = torch.randn(args.tokens, layer.input_size, generator=torch.Generator().manual_seed(1)).bfloat16()
        ref = F.linear(x_cpu.float(), dense)  # the CPU dequantizing reference, fp32
        x = x_cpu.cuda()
        method = layer.quant_method
        method.kernel = "auto"
        kernel = method.kernel_for(layer, x)
        outputs, times = {}, {}
        for mode in ("scaled_mm", "dequant"):
            method.kernel = mode
            try:
                outputs[mode] = layer(x)
                times[mode] = cuda_median_ms(lambda: layer(x), args.reps)
            except RuntimeError as exc:
                outputs[mode], times[mode] = None, float("nan")
                print(f"  {mode} could not run: {exc}")
        w_bf16 = dense.bfloat16().cuda()
        times["bf16 F.linear"] = cuda_median_ms(lambda: F.linear(x, w_bf16), args.reps)
        layout = "per-tensor" if block is None else f"block {block[0]}x{block[1]}"
        print(
            f"{name} {layout} [{args.tokens}x{layer.input_size}] x [{layer.output_size}x{layer.input_size}]: auto -> {kernel}"
        )
        for mode, out in outputs.items():
            if out is not None:
                err = _rel_l2(out, ref)
                print(
                    f"  {mode:<10} rel L2 vs CPU reference {err:.4e}  max abs {(out.float().cpu() - ref).abs().max().item():.4e}"
                    f"  {times[mode]:.4f} ms"
                )
                failed |= mode == "scaled_mm" and not err <= SCALED_MM_REL_L2_BOUND
        print(f"  bf16 F.linear (dense weights) {times['bf16 F.linear']:.4f} ms")
    print(f"scaled_mm bound: rel L2 <= {SCALED_MM_REL_L2_BOUND} -> {'FAIL' if failed else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
