"""FP8 (e4m3fn) weight quantization as serialized checkpoints store it.

A checkpoint declares ``"quant_method": "fp8"``; each quantized linear stores ``weight`` in
``float8_e4m3fn`` and ``weight_scale_inv``, the dequantization multiplier (DeepSeek-V3 / transformers
FineGrainedFP8 convention), per tensor or per ``weight_block_size`` block. Two ways to multiply,
chosen per call (:meth:`Fp8LinearMethod.kernel_for`): ``dequant`` (the weight dequantized, then
``F.linear``: the reference, everywhere) and ``scaled_mm`` (dynamic FP8 activations and
``torch._scaled_mm``, or block-wise ``scaled_mm`` on sm90); ``auto`` takes ``scaled_mm`` on CUDA
where shape and dtype allow. Conventions, kernels and the measured error (2.6 % rel L2 against
dequant, ``benchmarks/fp8_scaled_mm.py``): docs/models.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from reference_impl.quantization.linear import (
    LinearBase,
    LinearMethodBase,
    QuantizationConfig,
    QuantizationConfigError,
    ShardLayout,
    new_parameter,
)

Tensor = torch.Tensor
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
_SCALE_FLOOR = 1e-12  # an all-zero block still gets a positive scale
KERNELS = ("auto", "dequant", "scaled_mm")


# ---------------------------------------------------------------------------- (de)quantization
def _expand_blocks(scale: Tensor, block_size: tuple[int, int], shape: Sequence[int]) -> Tensor:
    """``[ceil(N/bn), ceil(K/bk)]`` block scales → ``[N, K]`` (edge blocks cropped)."""
    bn, bk = block_size
    n, k = shape
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def quantize_fp8(weight: Tensor, block_size: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
    """Quantize a ``[N, K]`` weight to e4m3fn; returns ``(weight_fp8, weight_scale_inv)``.

    Per tensor the scale is a 0-d fp32 tensor; per block ``[ceil(N/bn), ceil(K/bk)]`` fp32.
    Each scale is ``amax / 448`` of its tensor or block, so the block's largest value is exact.
    """
    w = weight.detach().float()
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8 expects a [N, K] weight, got shape {tuple(w.shape)}")
    if block_size is None:
        scale = (w.abs().amax() / FP8_MAX).clamp(min=_SCALE_FLOOR)
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.reshape(())
    bn, bk = (int(b) for b in block_size)
    n, k = w.shape
    padded = F.pad(w, (0, math.ceil(k / bk) * bk - k, 0, math.ceil(n / bn) * bn - n))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_SCALE_FLOOR)
    q = (w / _expand_blocks(scale, (bn, bk), w.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(
    weight: Tensor, scale_inv: Tensor, block_size: Sequence[int] | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``weight * scale_inv`` in fp32, cast once to ``dtype``; the scale is a scalar, ``[N]`` rows, or blocks."""
    w = weight.float()
    if block_size is not None:
        bn, bk = (int(b) for b in block_size)
        return (w * _expand_blocks(scale_inv.float(), (bn, bk), w.shape)).to(dtype)
    s = scale_inv.float()
    if s.numel() == 1:
        return (w * s.reshape(())).to(dtype)
    if s.numel() != w.shape[0]:
        raise ValueError(f"per-row scales {tuple(s.shape)} do not match a weight of {w.shape[0]} rows")
    return (w * s.reshape(-1, 1)).to(dtype)


def _quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-row activation quantization: ``[M, K]`` → fp8 and ``[M, 1]`` fp32 scales."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_SCALE_FLOOR)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _quantize_tensor(x: Tensor) -> tuple[Tensor, Tensor]:
    x32 = x.float()
    scale = (x32.abs().amax() / FP8_MAX).clamp(min=_SCALE_FLOOR)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _quantize_groups_1x128(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per token, per 128 channels: fp8 ``[M, K]`` and scales ``[M, K/128]`` stored column-major (torch's layout)."""
    m, k = x.shape
    groups = x.float().view(m, k // 128, 128)
    scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp(min=_SCALE_FLOOR)
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, k)
    return q, scale.t().contiguous().t()


def blockwise_scaled_mm_reason(x: Tensor, n: int, block_size: tuple[int, int] | None) -> str | None:
    """None when torch's blockwise FP8 GEMM can run this call, else why not."""
    if block_size != (128, 128):
        return f"blockwise scaled_mm needs 128x128 blocks, the checkpoint has {block_size}"
    if not x.is_cuda:
        return "blockwise scaled_mm runs only on CUDA"
    if not hasattr(F, "scaled_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    if torch.version.hip or torch.cuda.get_device_capability(x.device)[0] != 9:
        return "blockwise scaled_mm runs only on sm90 (Hopper)"
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 9):
        return f"blockwise scaled_mm needs CUDA >= 12.9 (torch built with {torch.version.cuda})"
    if x.dtype != torch.bfloat16:
        return f"blockwise scaled_mm outputs bf16 only, activations are {x.dtype}"
    if x.shape[-1] % 128 or n % 128:
        return f"blockwise scaled_mm needs K and N divisible by 128 (K={x.shape[-1]}, N={n})"
    return None


# ---------------------------------------------------------------------------- config
def _block_size(value: Any) -> tuple[int, int] | None:
    key = "quantization_config.weight_block_size"
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in value)
    ):
        raise QuantizationConfigError(f"must be two positive ints [block_n, block_k], got {value!r}", key)
    return int(value[0]), int(value[1])


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """FP8 e4m3fn weights with ``weight_scale_inv``, dynamic activation scaling.

    ``kernel`` is not a checkpoint key: it picks the matmul (``auto``/``dequant``/``scaled_mm``).
    """

    weight_block_size: tuple[int, int] | None = None
    kernel: str = "auto"

    name = "fp8"

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown FP8 kernel {self.kernel!r}; valid: {', '.join(KERNELS)}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Fp8Config:
        """Read ``quantization_config``; keys this implementation cannot honour are errors naming the key."""
        method = config.get("quant_method")
        if str(method).lower() != cls.name:
            raise QuantizationConfigError(f"expected 'fp8', got {method!r}", "quantization_config.quant_method")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise QuantizationConfigError(
                f"only 'dynamic' activation scaling is supported, got {scheme!r}",
                "quantization_config.activation_scheme",
            )
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantizationConfigError(f"only e4m3 weights are supported, got {fmt!r}", "quantization_config.fmt")
        for key in ("ignored_layers", "modules_to_not_convert"):
            skipped = [name for name in config.get(key) or () if not str(name).split(".")[-1].startswith("lm_head")]
            if skipped:
                # An encoder never builds lm_head; any other unconverted layer would need per-layer
                # methods this implementation does not have, so it is refused rather than misread.
                raise QuantizationConfigError(
                    f"unquantized layers are not supported here: {skipped}", f"quantization_config.{key}"
                )
        return cls(weight_block_size=_block_size(config.get("weight_block_size")))

    def get_quant_method(self, layer: LinearBase, prefix: str) -> LinearMethodBase:
        return Fp8LinearMethod(self)


# ---------------------------------------------------------------------------- method
_CPU_ROWWISE: bool | None = None


def _cpu_rowwise_scaled_mm_supported() -> bool:
    """Probe once: some torch builds (2.11 with CUDA, seen on an H200) accept only per-tensor scales on the CPU."""
    global _CPU_ROWWISE
    if _CPU_ROWWISE is None:
        a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        b = torch.zeros(16, 16).to(torch.float8_e4m3fn).t()
        try:
            torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
            _CPU_ROWWISE = True
        except (RuntimeError, NotImplementedError):
            _CPU_ROWWISE = False
    return _CPU_ROWWISE


class Fp8LinearMethod(LinearMethodBase):
    """FP8 weight + ``weight_scale_inv``; see the module docstring for the two matmuls."""

    def __init__(self, config: Fp8Config) -> None:
        self.block_size = config.weight_block_size
        self.kernel = config.kernel

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        n = sum(output_sizes)
        new_parameter(layer, "weight", torch.empty(n, input_size, dtype=FP8_DTYPE))
        if self.block_size is None:
            new_parameter(
                layer, "weight_scale_inv", torch.empty(len(output_sizes), dtype=torch.float32), ShardLayout("per_shard")
            )
        else:
            bn, bk = self.block_size
            for offset in layer.shard_offsets[1:]:
                if offset % bn:
                    raise ValueError(
                        f"{layer.prefix}: FP8 block height {bn} does not divide the shard boundary at output row "
                        f"{offset} (shard sizes {list(output_sizes)}): a block scale would straddle two checkpoint tensors"
                    )
            scale = torch.empty(math.ceil(n / bn), math.ceil(input_size / bk), dtype=torch.float32)
            new_parameter(layer, "weight_scale_inv", scale, ShardLayout("rows", bn))
        layer.fp8_ready = False

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Check the scales and, per tensor, expand shard scales to one per output row."""
        scale = layer.weight_scale_inv.data
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ValueError(f"{layer.prefix}.weight_scale_inv holds non-finite or non-positive scales")
        if self.block_size is None:
            sizes = torch.tensor(layer.output_sizes, device=scale.device)
            layer.register_buffer("weight_scale_rows", scale.repeat_interleave(sizes), persistent=False)
        layer.fp8_ready = True

    def dequantized_weight(self, layer: LinearBase, dtype: torch.dtype) -> Tensor:
        scale = layer.weight_scale_inv if self.block_size is not None else layer.weight_scale_rows
        return dequantize_fp8(layer.weight, scale, self.block_size, dtype)

    def kernel_for(self, layer: LinearBase, x: Tensor) -> str:
        """``dequant``, ``scaled_mm_tensorwise``, ``scaled_mm_rowwise`` or ``scaled_mm_blockwise`` for this call."""
        if self.kernel == "dequant":
            return "dequant"
        variant, reason = self.scaled_mm_variant(layer, x)
        if self.kernel == "auto":
            return variant if variant is not None and x.is_cuda else "dequant"
        if variant is None:
            raise RuntimeError(f"{layer.prefix}: FP8 kernel 'scaled_mm' cannot run: {reason}")
        return variant

    def scaled_mm_variant(self, layer: LinearBase, x: Tensor) -> tuple[str | None, str | None]:
        """(the scaled_mm variant this call can use, None) or (None, why none can)."""
        n, k = layer.weight.shape
        if self.block_size is not None:
            reason = blockwise_scaled_mm_reason(x, n, self.block_size)
            return (None, reason) if reason else ("scaled_mm_blockwise", None)
        if k % 16 or n % 16:
            return None, f"torch._scaled_mm needs K and N divisible by 16 (K={k}, N={n})"
        rows = layer.weight_scale_rows
        if bool((rows == rows[0]).all()):
            return "scaled_mm_tensorwise", None
        if x.dtype != torch.bfloat16:
            return (
                None,
                f"row-wise scaled_mm (shards with different scales) outputs bf16 only, activations are {x.dtype}",
            )
        if not x.is_cuda and not _cpu_rowwise_scaled_mm_supported():
            return None, f"this torch ({torch.__version__}) has no row-wise _scaled_mm on the CPU"
        return "scaled_mm_rowwise", None

    def apply(self, layer, x, bias):
        if not layer.fp8_ready:
            raise RuntimeError(f"{layer.prefix}: FP8 weights used before process_weights_after_loading")
        kernel = self.kernel_for(layer, x)
        if kernel == "dequant":
            return F.linear(x, self.dequantized_weight(layer, x.dtype), bias)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        w_t = layer.weight.t()  # [K, N] column-major, the layout _scaled_mm wants
        if kernel == "scaled_mm_tensorwise":
            xq, xs = _quantize_tensor(x2)
            out = torch._scaled_mm(
                xq, w_t, scale_a=xs, scale_b=layer.weight_scale_rows[:1].reshape(()), out_dtype=x.dtype
            )
        elif kernel == "scaled_mm_rowwise":
            xq, xs = _quantize_rows(x2)
            out = torch._scaled_mm(
                xq, w_t, scale_a=xs, scale_b=layer.weight_scale_rows.reshape(1, -1).contiguous(), out_dtype=x.dtype
            )
        else:
            xq, xs = _quantize_groups_1x128(x2)
            ws = layer.weight_scale_inv
            l4 = math.ceil(ws.shape[1] / 4) * 4
            ws = F.pad(ws, (0, l4 - ws.shape[1])).contiguous().t()  # [L4, N/128], stride [1, L4]
            out = F.scaled_mm(
                xq, w_t, xs, F.ScalingType.BlockWise1x128, ws, F.ScalingType.BlockWise128x128, output_dtype=x.dtype
            )
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])
