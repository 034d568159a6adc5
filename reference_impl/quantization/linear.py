"""Linear layers whose weights are created and applied by a pluggable quantization method.

A :class:`LinearBase` never owns its weight layout: its ``quant_method`` (from the checkpoint's
quantization config, :class:`UnquantizedLinearMethod` without one) creates the parameters,
multiplies and post-processes them once loaded, so an encoder loader can inspect the built model to
know whether it takes a quantized checkpoint (sglang seed 003). Packed layers (fused QKV, gate/up)
hold several checkpoint tensors along the output dim; each parameter carries
``weight_loader(param, loaded, shard_id=None)`` (the sglang/vLLM convention) and a
:class:`ShardLayout`: rows of a weight, rows of 128-row scale blocks, or one entry per shard.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor
ShardId = Hashable

FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz})


class QuantizationConfigError(ValueError):
    """A bad ``quantization_config``; the message names the key (``quantization_config.weight_block_size``)."""

    def __init__(self, message: str, key: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class LinearMethodBase(ABC):
    """Creates, applies and post-processes the parameters of one linear layer."""

    @abstractmethod
    def create_weights(
        self, layer: LinearBase, input_size: int, output_sizes: Sequence[int], params_dtype: torch.dtype
    ) -> None:
        """Register the layer's weight parameters (each with a ``shard_layout``)."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: Tensor, bias: Tensor | None) -> Tensor:
        """``x @ W.T + bias`` in whatever representation ``create_weights`` chose."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Turn loaded checkpoint tensors into the form ``apply`` wants (no-op by default)."""


class QuantizationConfig(ABC):
    """A checkpoint's ``quantization_config``, parsed: a factory of per-layer methods."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_config(cls, config: Mapping[str, Any]) -> QuantizationConfig:
        """Parse the dict found under ``quantization_config`` in config.json."""

    @abstractmethod
    def get_quant_method(self, layer: LinearBase, prefix: str) -> LinearMethodBase:
        """The method for the layer named ``prefix`` (UnquantizedLinearMethod to leave it alone)."""


@dataclass(frozen=True)
class ShardLayout:
    """How the shards of a packed layer map onto one of its parameters.

    ``rows``: shard ``i`` occupies output rows ``[offset_i, offset_i + size_i)``, divided by
    ``rows_per_entry`` (1 for a weight or bias, the block height for block scales).
    ``per_shard``: entry ``i`` belongs to shard ``i`` (per-tensor scales of a fused layer).
    """

    kind: str = "rows"
    rows_per_entry: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("rows", "per_shard") or self.rows_per_entry < 1:
            raise ValueError(f"bad ShardLayout({self.kind!r}, {self.rows_per_entry})")


def check_dtype_compatible(param: Tensor, loaded: Tensor) -> None:
    """Refuse copies that would silently change meaning: fp8 bits into a float weight or back."""
    if (param.dtype in FP8_DTYPES or loaded.dtype in FP8_DTYPES) and param.dtype != loaded.dtype:
        raise ValueError(
            f"dtype {loaded.dtype} cannot load into a {param.dtype} parameter (no implicit (de)quantization)"
        )


def copy_checked(dest: Tensor, loaded: Tensor) -> None:
    """Copy ``loaded`` into ``dest`` after a shape and fp8-dtype check; a 1-element tensor fills a 1-element slot."""
    check_dtype_compatible(dest, loaded)
    if tuple(loaded.shape) != tuple(dest.shape):
        if not (loaded.numel() == 1 and dest.numel() == 1):
            raise ValueError(f"shape {list(loaded.shape)} does not fit the expected {list(dest.shape)}")
        loaded = loaded.reshape(dest.shape)
    with torch.no_grad():
        dest.copy_(loaded)


def default_weight_loader(param: Tensor, loaded: Tensor) -> None:
    """Loader for parameters outside packed layers (embeddings, norms)."""
    copy_checked(param.data, loaded)


def new_parameter(layer: nn.Module, name: str, data: Tensor, layout: ShardLayout = ShardLayout()) -> nn.Parameter:
    """Register a frozen parameter with its layout and the layer's ``weight_loader`` attached."""
    param = nn.Parameter(data, requires_grad=False)
    param.shard_layout = layout  # type: ignore[attr-defined]
    param.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


class UnquantizedLinearMethod(LinearMethodBase):
    """A plain ``[out, in]`` weight in the model dtype and ``F.linear``."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        new_parameter(layer, "weight", torch.empty(sum(output_sizes), input_size, dtype=params_dtype))

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)


class LinearBase(nn.Module):
    """A linear layer made of ``len(output_sizes)`` output shards whose parameters its ``quant_method`` owns.

    ``shard_ids`` name the shards the checkpoint stores separately (``('q', 'k', 'v')``); a
    layer with one shard takes whole tensors (``shard_id=None``).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard_ids: Sequence[ShardId] | None = None,
    ) -> None:
        super().__init__()
        if input_size <= 0 or not output_sizes or any(n <= 0 for n in output_sizes):
            raise ValueError(
                f"{prefix or type(self).__name__}: sizes must be positive (in {input_size}, out {list(output_sizes)})"
            )
        self.input_size = input_size
        self.output_sizes = tuple(int(n) for n in output_sizes)
        self.output_size = sum(self.output_sizes)
        self.shard_ids: tuple[ShardId, ...] = tuple(shard_ids) if shard_ids is not None else ()
        if self.shard_ids and len(self.shard_ids) != len(self.output_sizes):
            raise ValueError(f"{prefix}: {len(self.shard_ids)} shard ids for {len(self.output_sizes)} output shards")
        self.shard_offsets = tuple(sum(self.output_sizes[:i]) for i in range(len(self.output_sizes)))
        self.prefix = prefix
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.quant_method: LinearMethodBase = (
            quant_config.get_quant_method(self, prefix) if quant_config is not None else UnquantizedLinearMethod()
        )
        self.quant_method.create_weights(self, input_size, self.output_sizes, self.params_dtype)
        if bias:
            new_parameter(self, "bias", torch.zeros(self.output_size, dtype=self.params_dtype))
        else:
            self.register_parameter("bias", None)

    @property
    def is_quantized(self) -> bool:
        return not isinstance(self.quant_method, UnquantizedLinearMethod)

    def forward(self, x: Tensor) -> Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: ShardId | None = None) -> None:
        """Copy a checkpoint tensor into ``param``: whole, or into shard ``shard_id``'s slice."""
        if shard_id is None:
            if len(self.output_sizes) > 1:
                raise ValueError(f"{self.prefix}: a packed layer needs a shard_id (one of {list(self.shard_ids)})")
            copy_checked(param.data, loaded)
            return
        if shard_id not in self.shard_ids:
            raise ValueError(f"{self.prefix}: unknown shard_id {shard_id!r} (valid: {list(self.shard_ids)})")
        index = self.shard_ids.index(shard_id)
        layout: ShardLayout = getattr(param, "shard_layout", ShardLayout())
        if layout.kind == "per_shard":
            copy_checked(param.data[index : index + 1], loaded)
            return
        offset, size = self.shard_offsets[index], self.output_sizes[index]
        start = offset // layout.rows_per_entry
        stop = math.ceil((offset + size) / layout.rows_per_entry)
        copy_checked(param.data.narrow(0, start, stop - start), loaded)

    def extra_repr(self) -> str:
        method = type(self.quant_method).__name__
        return (
            f"in={self.input_size}, out={list(self.output_sizes)}, bias={self.bias is not None}, quant_method={method}"
        )


class ReplicatedLinear(LinearBase):
    """One output shard: the projection a checkpoint stores as a single tensor (o_proj, down_proj)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, [output_size], bias, params_dtype, quant_config, prefix)


class MergedColumnLinear(LinearBase):
    """Several projections of the same input fused along the output dim (gate/up: shard ids 0, 1)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard_ids: Sequence[ShardId] | None = None,
    ) -> None:
        ids = shard_ids if shard_ids is not None else range(len(output_sizes))
        super().__init__(input_size, output_sizes, bias, params_dtype, quant_config, prefix, ids)


class QKVLinear(MergedColumnLinear):
    """Fused q/k/v projection (shard ids ``'q'``, ``'k'``, ``'v'``); GQA gives k and v fewer heads."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        kv = num_kv_heads if num_kv_heads is not None else num_heads
        sizes = [num_heads * head_size, kv * head_size, kv * head_size]
        super().__init__(hidden_size, sizes, bias, params_dtype, quant_config, prefix, ("q", "k", "v"))
        self.head_size, self.num_heads, self.num_kv_heads = head_size, num_heads, kv


def quantized_linear_layers(model: nn.Module) -> list[LinearBase]:
    """The layers whose method is a real quantization method (not None, not unquantized)."""
    return [
        m
        for m in model.modules()
        if isinstance(m, LinearBase)
        and m.quant_method is not None
        and not isinstance(m.quant_method, UnquantizedLinearMethod)
    ]
