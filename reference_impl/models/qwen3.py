"""Qwen3 text encoder (the Flux Klein text encoder) with masked causal attention (sglang seed 002).

Architecture as transformers' ``Qwen3Model``; its linear layers are :class:`LinearBase` layers, so an FP8
checkpoint builds FP8 layers and the encoder loader can admit it (seed 003). Masked causal attention from
``attention_lengths = attention_mask.sum(-1)`` (right padding): a valid query attends causally to valid keys, a
padding query to every valid key (what transformers' causal+padding mask gives it too), a zero-length row gives
zeros. The batch takes ONE masked attention call with a ``[B, 1, S, S]`` boolean mask; a batch whose rows are all
full takes plain causal attention, so fused causal kernels apply. The layers and the rule in full: docs/models.md,
"The Qwen3 text encoder".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from reference_impl.attention.backends import BACKENDS
from reference_impl.attention.layer import LocalAttention
from reference_impl.models.encoder_loader import NativeEncoderMixin, load_text_encoder
from reference_impl.models.layers import ModelConfig, ModelConfigError, RMSNorm, apply_rope, rope_cos_sin
from reference_impl.quantization import MergedColumnLinear, QKVLinear, QuantizationConfig, ReplicatedLinear

Tensor = torch.Tensor

# The masked call needs a backend that takes a mask; the all-full causal call may use any.
MASK_CAPABLE_BACKENDS = tuple(enum for enum, cls in BACKENDS.items() if cls.supports_mask)


@dataclass(frozen=True)
class Qwen3EncoderConfig(ModelConfig):
    """The config.json keys the encoder uses (others are ignored, unsupported variants refused)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    hidden_act: str = "silu"

    def validate(self) -> None:
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if getattr(self, key) <= 0:
                raise self.error(key, f"must be positive, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise self.error(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}",
            )
        if self.head_dim % 2:
            raise self.error("head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise self.error("hidden_act", f"Qwen3 uses 'silu', got {self.hidden_act!r}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise self.error("rms_norm_eps" if self.rms_norm_eps <= 0 else "rope_theta", "must be positive")

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> Qwen3EncoderConfig:
        """Read a transformers Qwen3 config.json dict (4.x ``rope_theta`` or 5.x ``rope_parameters``)."""
        names = {
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "attention_bias",
            "hidden_act",
        }
        data = {k: hf[k] for k in names if hf.get(k) is not None}
        if "num_key_value_heads" not in data and "num_attention_heads" in data:
            data["num_key_value_heads"] = data["num_attention_heads"]
        if (
            "head_dim" not in data
            and isinstance(data.get("hidden_size"), int)
            and isinstance(data.get("num_attention_heads"), int)
        ):
            if data["num_attention_heads"] > 0:
                data["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        rope_key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
        rope = hf.get(rope_key)
        theta = hf.get("rope_theta")
        if rope is not None:
            if not isinstance(rope, Mapping):
                raise ModelConfigError(f"must be an object, got {rope!r}", rope_key)
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind != "default":
                raise ModelConfigError(f"only default RoPE is implemented, got {kind!r}", f"{rope_key}.rope_type")
            theta = rope.get("rope_theta", theta)
        if theta is not None:
            data["rope_theta"] = theta
        if hf.get("use_sliding_window"):
            raise ModelConfigError("sliding-window attention is not implemented for the encoder", "use_sliding_window")
        if any(t != "full_attention" for t in hf.get("layer_types") or ()):
            raise ModelConfigError(
                f"only full_attention layers are implemented, got {hf['layer_types']}", "layer_types"
            )
        return cls.from_dict(data)


def _dtype_from_config(hf: Mapping[str, Any]) -> torch.dtype:
    key = "dtype" if hf.get("dtype") is not None else "torch_dtype"
    name = hf.get(key)
    if name is None:
        return torch.float32
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelConfigError(f"not a floating torch dtype: {name!r}", key)
    return dtype


def attention_lengths(attention_mask: Tensor | None, batch: int, seq_len: int, device: torch.device) -> Tensor:
    """Valid lengths ``[B]`` from a right-padded 0/1 mask (None: every row full); other masks are refused."""
    if attention_mask is None:
        return torch.full((batch,), seq_len, dtype=torch.long, device=device)
    if tuple(attention_mask.shape) != (batch, seq_len):
        raise ValueError(f"attention_mask must be [B, S] = [{batch}, {seq_len}], got {tuple(attention_mask.shape)}")
    lengths = attention_mask.to(torch.long).sum(-1)
    expected = torch.arange(seq_len, device=attention_mask.device) < lengths[:, None]
    if not torch.equal(attention_mask.to(torch.long), expected.to(torch.long)):
        raise ValueError("attention_mask must be right-padded: on every row ones, then zeros")
    return lengths.to(device)


@dataclass(frozen=True)
class CausalMaskPlan:
    """What every attention layer of one forward needs from ``attention_lengths``, built once.

    ``mask``: ``[B, 1, S, S]`` bool (True = attend), or None when every row is full (plain
    causal). Valid query rows are causal over valid keys; padding query rows see every valid
    key with no causal limit; zero-length rows see every key (a finite softmax rather than
    NaN) and ``empty_rows`` marks them so their output is zeroed.
    """

    mask: Tensor | None
    empty_rows: Tensor | None

    @classmethod
    def from_lengths(cls, lengths: Tensor, seq_len: int) -> CausalMaskPlan:
        if lengths.dim() != 1 or bool(((lengths < 0) | (lengths > seq_len)).any()):
            raise ValueError(f"lengths must be [B] with values in [0, {seq_len}], got {lengths.tolist()}")
        if bool((lengths == seq_len).all()):
            return cls(None, None)
        pos = torch.arange(seq_len, device=lengths.device)
        n = lengths.view(-1, 1, 1)
        key_valid = pos.view(1, 1, -1) < n
        query_padding = pos.view(1, -1, 1) >= n
        causal = pos.view(-1, 1) >= pos.view(1, -1)
        allowed = key_valid & (causal | query_padding) | (n == 0)
        empty = lengths == 0
        return cls(allowed.unsqueeze(1), empty if bool(empty.any()) else None)


class MaskedCausalAttention(nn.Module):
    """Masked causal attention on ``[B, S, H, D]`` in one call for the whole batch (GQA: fewer KV heads).

    Two ``LocalAttention`` layers of the same component: a causal one for all-full batches
    (any backend, fused causal kernels included) and a masked one restricted to backends that
    take a mask.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, dtype: torch.dtype, component: str) -> None:
        super().__init__()
        self.causal = LocalAttention(num_heads, head_dim, num_kv_heads, causal=True, dtype=dtype, component=component)
        self.masked = LocalAttention(
            num_heads,
            head_dim,
            num_kv_heads,
            causal=False,
            supported_attention_backends=MASK_CAPABLE_BACKENDS,
            dtype=dtype,
            component=component,
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, plan: CausalMaskPlan) -> Tensor:
        attn = self.causal if plan.mask is None else self.masked
        out = attn(q.to(attn.dtype), k.to(attn.dtype), v.to(attn.dtype), attn_mask=plan.mask).to(q.dtype)
        if plan.empty_rows is not None:
            out = out.masked_fill(plan.empty_rows.view(-1, 1, 1, 1), 0.0)
        return out


@dataclass
class Qwen3EncoderOutput:
    """``hidden_states`` follows transformers: embeddings first, the final normed state last."""

    last_hidden_state: Tensor
    hidden_states: tuple[Tensor, ...] | None = None


class Qwen3Attention(nn.Module):
    def __init__(
        self,
        cfg: Qwen3EncoderConfig,
        quant_config: QuantizationConfig | None,
        dtype: torch.dtype,
        prefix: str,
        component: str,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.qkv_proj = QKVLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.attention_bias,
            dtype,
            quant_config,
            f"{prefix}.qkv_proj",
        )
        self.o_proj = ReplicatedLinear(
            cfg.num_attention_heads * cfg.head_dim,
            cfg.hidden_size,
            cfg.attention_bias,
            dtype,
            quant_config,
            f"{prefix}.o_proj",
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps).to(dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps).to(dtype)
        self.attn = MaskedCausalAttention(
            cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads, dtype, component
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, plan: CausalMaskPlan) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = apply_rope(self.q_norm(q.reshape(b, s, self.num_heads, self.head_dim)), cos, sin, interleaved=False)
        k = apply_rope(self.k_norm(k.reshape(b, s, self.num_kv_heads, self.head_dim)), cos, sin, interleaved=False)
        v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, plan)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    def __init__(
        self, cfg: Qwen3EncoderConfig, quant_config: QuantizationConfig | None, dtype: torch.dtype, prefix: str
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, False, dtype, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = ReplicatedLinear(
            cfg.intermediate_size, cfg.hidden_size, False, dtype, quant_config, f"{prefix}.down_proj"
        )

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Qwen3DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: Qwen3EncoderConfig,
        quant_config: QuantizationConfig | None,
        dtype: torch.dtype,
        prefix: str,
        component: str,
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, quant_config, dtype, f"{prefix}.self_attn", component)
        self.mlp = Qwen3MLP(cfg, quant_config, dtype, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, plan: CausalMaskPlan) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3TextEncoder(NativeEncoderMixin, nn.Module):
    """Qwen3 as a text encoder; loads transformers-layout safetensors directories (plain or FP8).

    ``forward`` runs attention through ``LocalAttention``, so call it inside
    ``set_forward_context``; backend overrides for the component (``text_encoder=...``) apply.
    """

    stacked_params_mapping = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def __init__(
        self,
        config: Qwen3EncoderConfig,
        quant_config: QuantizationConfig | None = None,
        dtype: torch.dtype = torch.float32,
        component: str = "text_encoder",
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, quant_config, dtype, f"layers.{i}", component)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps).to(dtype)

    @classmethod
    def from_config(
        cls,
        hf_config: Mapping[str, Any],
        quant_config: QuantizationConfig | None = None,
        dtype: torch.dtype | None = None,
        component: str = "text_encoder",
    ) -> Qwen3TextEncoder:
        config = Qwen3EncoderConfig.from_hf_config(hf_config)
        return cls(config, quant_config, dtype if dtype is not None else _dtype_from_config(hf_config), component)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        component: str = "text_encoder",
    ) -> Qwen3TextEncoder:
        """Load a transformers-layout directory (safetensors only; FP8 checkpoints included)."""
        model = load_text_encoder(directory, model_cls=cls, component=component, device=device, dtype=dtype)
        assert isinstance(model, cls)
        return model

    def checkpoint_key(self, name: str) -> str | None:
        """Accept ``Qwen3Model`` (bare) and ``Qwen3ForCausalLM`` (``model.``) names; the LM head is unused."""
        if name.startswith("lm_head.") or name.endswith("rotary_emb.inv_freq"):
            return None
        return name.removeprefix("model.")

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, output_hidden_states: bool = False
    ) -> Qwen3EncoderOutput:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
        batch, seq_len = input_ids.shape
        lengths = attention_lengths(attention_mask, batch, seq_len, input_ids.device)
        plan = CausalMaskPlan.from_lengths(lengths, seq_len)
        cos, sin = rope_cos_sin(
            torch.arange(seq_len, device=input_ids.device), self.config.head_dim, self.config.rope_theta
        )
        h = self.embed_tokens(input_ids)
        states = [h]
        for layer in self.layers:
            h = layer(h, cos, sin, plan)
            if output_hidden_states:
                states.append(h)
        h = self.norm(h)
        return Qwen3EncoderOutput(h, tuple(states[:-1]) + (h,) if output_hidden_states else None)
