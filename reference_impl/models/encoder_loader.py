"""Text-encoder loading with fail-closed admission of quantized checkpoints (sglang seed 003).

When config.json declares ``quantization_config``, the encoder class must be an in-tree native encoder
(:class:`NativeEncoderMixin`) and the model it builds from that config must hold at least one quantized linear.
Both are checked after construction and before a tensor is read, so an incompatible (checkpoint, implementation)
pair fails with :class:`ComponentCheckpointUnsupportedError` instead of loading FP8 bits into float weights or
failing halfway. No model-name allow-list: the built layers are the evidence. The two exceptions (classes with
``manages_checkpoint_quantization = True``, bitsandbytes 4-bit) and the post-load processing: docs/models.md,
"Text encoder loading".
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from reference_impl.models.checkpoint import SafetensorsCheckpoint
from reference_impl.quantization import (
    QUANTIZATION_METHODS,
    QuantizationConfig,
    default_weight_loader,
    get_quantization_config,
    quant_method_name,
    quantized_linear_layers,
)

Tensor = torch.Tensor

# model_type in config.json -> "module:Class" of the native encoder that reads it.
NATIVE_ENCODERS: dict[str, str] = {"qwen3": "reference_impl.models.qwen3:Qwen3TextEncoder"}


class ComponentCheckpointUnsupportedError(RuntimeError):
    """This component's checkpoint cannot be loaded by this implementation (raised before any weight is read)."""


class NativeEncoderMixin:
    """Marks an in-tree encoder built from :class:`LinearBase` layers, which may take a quant config.

    Subclasses implement ``from_config`` and declare ``stacked_params_mapping``: (packed param
    name part, checkpoint name part, shard id) triples such as ``(".qkv_proj", ".q_proj", "q")``.
    """

    stacked_params_mapping: ClassVar[tuple[tuple[str, str, Any], ...]] = ()
    manages_checkpoint_quantization: ClassVar[bool] = False

    @classmethod
    def from_config(
        cls,
        hf_config: Mapping[str, Any],
        quant_config: QuantizationConfig | None = None,
        dtype: torch.dtype | None = None,
        component: str = "text_encoder",
    ) -> nn.Module:
        """Build the (unloaded) model from a config.json dict."""
        raise NotImplementedError(f"{cls.__name__} must implement from_config")

    def checkpoint_key(self, name: str) -> str | None:
        """The module-relative name of checkpoint tensor ``name``; None for tensors an encoder does not use."""
        return name

    def expected_checkpoint_tensors(self) -> dict[str, tuple[str, Any]]:
        """``{checkpoint key: (parameter name, shard id or None)}`` for every tensor this model needs."""
        assert isinstance(self, nn.Module)
        table: dict[str, tuple[str, Any]] = {}
        for pname, _ in self.named_parameters():
            packed = [(part, src, sid) for part, src, sid in self.stacked_params_mapping if f"{part}." in pname]
            for part, src, sid in packed:
                table[pname.replace(f"{part}.", f"{src}.")] = (pname, sid)
            if not packed:
                table[pname] = (pname, None)
        return table

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Load ``(checkpoint name, tensor)`` pairs through each parameter's ``weight_loader``.

        Packed parameters get their shard id. Unknown, misshapen or missing tensors are errors
        naming the checkpoint tensor. Returns the names of the parameters loaded.
        """
        assert isinstance(self, nn.Module)
        params = dict(self.named_parameters())
        table = self.expected_checkpoint_tensors()
        seen: set[str] = set()
        for name, tensor in weights:
            key = self.checkpoint_key(name)
            if key is None:
                continue
            if key not in table:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
            pname, shard_id = table[key]
            param = params[pname]
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is None:
                    default_weight_loader(param, tensor)
                elif shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc
            seen.add(key)
        missing = sorted(set(table) - seen)
        if missing:
            raise ValueError(f"{type(self).__name__}: checkpoint lacks tensors: {', '.join(missing)}")
        return {table[k][0] for k in seen}


def _resolve_model_cls(hf_config: Mapping[str, Any]) -> type:
    model_type = hf_config.get("model_type")
    if model_type not in NATIVE_ENCODERS:
        raise ValueError(
            f"config.json key 'model_type' is {model_type!r}; native encoders exist for: {', '.join(NATIVE_ENCODERS)}"
        )
    module, _, name = NATIVE_ENCODERS[model_type].partition(":")
    return getattr(importlib.import_module(module), name)


def is_bnb_4bit(quantization_config: Mapping[str, Any]) -> bool:
    """Standard bitsandbytes 4-bit (``quant_method: bitsandbytes`` with ``load_in_4bit``)."""
    return quant_method_name(quantization_config) == "bitsandbytes" and bool(
        quantization_config.get("load_in_4bit") or quantization_config.get("_load_in_4bit")
    )


def _load_bnb_4bit(
    directory: os.PathLike[str] | str, model_cls: type, component: str, device: torch.device
) -> nn.Module:
    """BnB 4-bit keeps transformers' own quantized modules: delegate the whole load."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ComponentCheckpointUnsupportedError(
            f"the {component!r} checkpoint is bitsandbytes 4-bit, whose loading is delegated to transformers "
            "and needs the bitsandbytes package, which is not installed (pip install bitsandbytes)"
        )
    import transformers

    target = model_cls if issubclass(model_cls, transformers.PreTrainedModel) else transformers.AutoModel
    return target.from_pretrained(str(directory), device_map={"": str(device)})


def require_quantized_layers(model: nn.Module, component: str) -> None:
    """Admission: a quantized checkpoint needs a model that built at least one quantized linear."""
    if quantized_linear_layers(model):
        return
    raise ComponentCheckpointUnsupportedError(
        f"the {component!r} checkpoint declares quantization, but the native {type(model).__name__} "
        f"implementation does not construct quantized linear layers for {component!r}"
    )


def _layer_device(module: nn.Module) -> torch.device | None:
    for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        return tensor.device
    return None


def process_quantized_weights(model: nn.Module, processing_device: torch.device, component: str) -> int:
    """Run ``process_weights_after_loading`` on every quantized layer; returns how many ran."""
    layers = quantized_linear_layers(model)
    for layer in layers:
        origin = _layer_device(layer)
        stage = origin is not None and origin != processing_device
        if stage:
            layer.to(processing_device)
        try:
            layer.quant_method.process_weights_after_loading(layer)
        finally:
            # Processing may register buffers or replace parameters: move the whole layer back.
            if stage:
                layer.to(origin)
    if not layers:  # load_text_encoder admits no such model; a direct caller that skipped admission is told
        raise ValueError(f"the {component!r} checkpoint declares quantization, but no quantized linear layer was built")
    return len(layers)


def load_text_encoder(
    source: str | os.PathLike[str] | SafetensorsCheckpoint,
    model_cls: type | None = None,
    component: str = "text_encoder",
    device: str | torch.device = "cpu",
    processing_device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Build and load a text encoder from a transformers-layout directory, in eval mode.

    ``source`` may be an open :class:`SafetensorsCheckpoint` (its ``tensors_read`` then shows
    what the loader read). ``model_cls`` defaults to the native encoder for config.json's
    ``model_type``; a class that is not native takes the transformers path
    (``model_cls.from_pretrained``), which is refused for quantized checkpoints other than
    bitsandbytes 4-bit. ``processing_device`` (default: ``device``) is where quantized layers
    are post-processed.
    """
    checkpoint = source if isinstance(source, SafetensorsCheckpoint) else SafetensorsCheckpoint(source)
    hf_config = checkpoint.config
    model_cls = model_cls if model_cls is not None else _resolve_model_cls(hf_config)
    device = torch.device(device)
    native = isinstance(model_cls, type) and issubclass(model_cls, NativeEncoderMixin)
    self_managed = bool(getattr(model_cls, "manages_checkpoint_quantization", False))
    declared = hf_config.get("quantization_config")

    quant_config: QuantizationConfig | None = None
    if declared is not None and not self_managed:
        if is_bnb_4bit(declared):
            return _load_bnb_4bit(checkpoint.directory, model_cls, component, device)
        method = quant_method_name(declared)
        if not native:
            raise ComponentCheckpointUnsupportedError(
                f"the {component!r} checkpoint declares {method!r} quantization, which requires an in-tree native "
                f"encoder; {getattr(model_cls, '__name__', model_cls)} is not one"
            )
        if method not in QUANTIZATION_METHODS:
            raise ComponentCheckpointUnsupportedError(
                f"the {component!r} checkpoint declares {method!r} quantization; {model_cls.__name__} supports "
                f"{', '.join(sorted(QUANTIZATION_METHODS))}"
            )
        quant_config = get_quantization_config(declared)
    if not native:
        return model_cls.from_pretrained(str(checkpoint.directory)).to(device).eval()

    with device:
        model = model_cls.from_config(hf_config, quant_config=quant_config, dtype=dtype, component=component)
    if quant_config is not None:
        require_quantized_layers(model, component)  # before any tensor is read: fail closed
    model.load_weights(checkpoint.iter_tensors())
    if quant_config is not None:
        target = torch.device(processing_device) if processing_device is not None else device
        process_quantized_weights(model, target, component)
    return model.eval()


__all__ = [
    "NATIVE_ENCODERS",
    "ComponentCheckpointUnsupportedError",
    "NativeEncoderMixin",
    "is_bnb_4bit",
    "load_text_encoder",
    "process_quantized_weights",
    "require_quantized_layers",
]
