"""Quantized linear layers and the checkpoint quantization configs that choose them.

``get_quantization_config`` turns config.json's ``quantization_config`` into a
:class:`QuantizationConfig`; models pass it to their :class:`LinearBase` layers, whose
``quant_method`` then says whether each layer is really quantized.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reference_impl.quantization.fp8 import Fp8Config, Fp8LinearMethod, dequantize_fp8, quantize_fp8
from reference_impl.quantization.linear import (
    LinearBase,
    LinearMethodBase,
    MergedColumnLinear,
    QKVLinear,
    QuantizationConfig,
    QuantizationConfigError,
    ReplicatedLinear,
    ShardLayout,
    UnquantizedLinearMethod,
    default_weight_loader,
    quantized_linear_layers,
)

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {Fp8Config.name: Fp8Config}


def quant_method_name(quantization_config: Mapping[str, Any]) -> str:
    """The declared ``quant_method`` (lower-cased); a missing one is an error naming the key."""
    if not isinstance(quantization_config, Mapping):
        raise QuantizationConfigError(
            f"must be an object, got {type(quantization_config).__name__}", "quantization_config"
        )
    method = quantization_config.get("quant_method")
    if not isinstance(method, str) or not method:
        raise QuantizationConfigError(f"must name the method, got {method!r}", "quantization_config.quant_method")
    return method.lower()


def get_quantization_config(quantization_config: Mapping[str, Any]) -> QuantizationConfig:
    """Parse a checkpoint's ``quantization_config``; unknown methods name the supported ones."""
    method = quant_method_name(quantization_config)
    if method not in QUANTIZATION_METHODS:
        raise QuantizationConfigError(
            f"unsupported method {method!r} (supported: {', '.join(sorted(QUANTIZATION_METHODS))})",
            "quantization_config.quant_method",
        )
    return QUANTIZATION_METHODS[method].from_config(quantization_config)


__all__ = [
    "QUANTIZATION_METHODS",
    "Fp8Config",
    "Fp8LinearMethod",
    "LinearBase",
    "LinearMethodBase",
    "MergedColumnLinear",
    "QKVLinear",
    "QuantizationConfig",
    "QuantizationConfigError",
    "ReplicatedLinear",
    "ShardLayout",
    "UnquantizedLinearMethod",
    "default_weight_loader",
    "dequantize_fp8",
    "get_quantization_config",
    "quant_method_name",
    "quantize_fp8",
    "quantized_linear_layers",
]
