"""MiniMax-H3 style VAE attention: the video ViT decoder and the audio VAE's causal attention.

Behaviour follows sglang's change that moved both VAE attentions onto USPAttention (seed 000): the video
``Attention`` goes through ``USPAttention`` inside ``attention_component("video_vae")`` for fp16/bf16 on CUDA and
calls SDPA directly otherwise (MATH kernel on ROCm gfx95*), the branch taken kept in ``last_dispatch``; the
audio ``CausalAttention`` is fp32 causal SDPA unless a fused backend is chosen, which it casts to and back from.
Unlike sglang, the gfx95 decision is read at call time, not frozen at import, so every branch is testable under
``PARITY_PLATFORM``. ``ViT3DDecoder``: latent tokens → TransformerBlocks → unpatchify to frames; the released
decoder is non-causal, so ``t_causal=True`` is refused rather than half supported. Why each branch is what it
is: docs/models.md, "VAE attention".
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from reference_impl.attention.backends import AttentionBackendEnum, pinned_sdpa_kernel
from reference_impl.attention.layer import USPAttention
from reference_impl.attention.selector import attention_component
from reference_impl.forward_context import set_forward_context
from reference_impl.models.layers import (
    ModelConfig,
    RMSNorm,
    apply_rope,
    axial_rope_cos_sin,
    grid_positions,
    load_safetensors_into,
)
from reference_impl.platform import current_platform

Tensor = torch.Tensor

VIDEO_VAE_COMPONENT = "video_vae"
AUDIO_VAE_COMPONENT = "audio_vae"
AUDIO_VAE_BACKENDS = frozenset({AttentionBackendEnum.FA, AttentionBackendEnum.TORCH_SDPA})
QK_NORM_TYPES = (None, "rms_norm")
_HALF = (torch.float16, torch.bfloat16)


def _rocm_forces_math_sdpa() -> bool:
    """gfx95* fused ROCm SDPA corrupts the dense ViT decode (seed 000); asked per call, never at import."""
    return current_platform.is_rocm() and "gfx95" in (current_platform.gcn_arch or "")


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, kernel: str | None) -> Tensor:
    """Direct SDPA on ``[B, S, H, D]`` (the fp32 / non-CUDA path)."""
    with pinned_sdpa_kernel(kernel):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Video VAE self-attention on ``[B, S, embed_dim]``; ``last_dispatch`` names the branch that ran.

    ``last_dispatch`` is ``"usp:<backend>"``, ``"sdpa"`` or ``"sdpa-math"``.
    """

    def __init__(
        self, heads: int, dim_head: int, embed_dim: int | None = None, qk_norm_type: str | None = None
    ) -> None:
        super().__init__()
        if qk_norm_type not in QK_NORM_TYPES:
            raise ValueError(f"qk_norm_type={qk_norm_type!r} is not supported; valid: {QK_NORM_TYPES}")
        self.heads = heads
        self.dim_head = dim_head
        inner = heads * dim_head
        embed_dim = embed_dim if embed_dim is not None else inner
        self.to_qkv = nn.Linear(embed_dim, 3 * inner)
        self.to_out = nn.Linear(inner, embed_dim)
        # The released checkpoints normalise q/k per head without a learned scale.
        self.norm_q = RMSNorm(dim_head, elementwise_affine=False) if qk_norm_type else None
        self.norm_k = RMSNorm(dim_head, elementwise_affine=False) if qk_norm_type else None
        self.attn: USPAttention | None = None
        if current_platform.is_cuda():
            with attention_component(VIDEO_VAE_COMPONENT):
                # Tiles are decoded whole on each rank: backend dispatch without SP collectives.
                # Selected for bf16 because only half-precision inputs take this path.
                self.attn = USPAttention(
                    heads, dim_head, causal=False, skip_sequence_parallel=True, dtype=torch.bfloat16
                )
        self.last_dispatch: str | None = None

    def forward(self, hidden_states: Tensor, rotary_pos_emb: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``rotary_pos_emb``: RoPE tables ``(cos, sin)`` of shape ``[S, dim_head / 2]`` for q and k."""
        batch, seq, _ = hidden_states.shape
        qkv = self.to_qkv(hidden_states).view(batch, seq, self.heads, 3 * self.dim_head)
        query, key, value = qkv.chunk(3, dim=-1)
        if self.norm_q is not None and self.norm_k is not None:
            query, key = self.norm_q(query), self.norm_k(key)
        if rotary_pos_emb is not None:
            query, key = apply_rope(query, *rotary_pos_emb), apply_rope(key, *rotary_pos_emb)
        out = self._attend(query, key, value)
        return self.to_out(out.reshape(batch, seq, -1))

    def _attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        if self.attn is not None and query.dtype in _HALF:
            self.last_dispatch = f"usp:{self.attn.backend.value}"
            return self.attn(query, key, value)
        math = _rocm_forces_math_sdpa()
        self.last_dispatch = "sdpa-math" if math else "sdpa"
        return _sdpa(query, key, value, causal=False, kernel="math" if math else None)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, qk_norm_type: str | None) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"hidden size {dim} is not divisible by {heads} heads")
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(heads, dim // heads, dim, qk_norm_type)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))

    def forward(self, x: Tensor, rotary_pos_emb: tuple[Tensor, Tensor] | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), rotary_pos_emb)
        return x + self.mlp(self.norm2(x))


@dataclass(frozen=True)
class ViT3DDecoderConfig(ModelConfig):
    """A ViT video decoder: each latent voxel becomes one token and decodes to a ``patch_size`` block of pixels.

    ``t_causal`` is accepted so a released config parses, but the decoder refuses True.
    """

    latent_channels: int = 4
    out_channels: int = 3
    hidden_size: int = 32
    num_heads: int = 2
    num_layers: int = 2
    mlp_ratio: float = 2.0
    patch_size: tuple[int, ...] = (1, 4, 4)  # (t, h, w) pixels per latent voxel
    qk_norm_type: str | None = "rms_norm"
    rope_axes_dims: tuple[int, ...] = (4, 6, 6)  # RoPE channels per (t, h, w) axis; sums to the head dim
    rope_theta: float = 10000.0
    t_causal: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self) -> None:
        for key in ("latent_channels", "out_channels", "hidden_size", "num_heads", "num_layers"):
            if getattr(self, key) <= 0:
                raise self.error(key, f"must be positive, got {getattr(self, key)}")
        if self.hidden_size % self.num_heads:
            raise self.error("num_heads", f"{self.num_heads} does not divide hidden_size={self.hidden_size}")
        if len(self.patch_size) != 3 or any(p <= 0 for p in self.patch_size):
            raise self.error("patch_size", f"must be three positive (t, h, w) sizes, got {list(self.patch_size)}")
        if self.qk_norm_type not in QK_NORM_TYPES:
            raise self.error("qk_norm_type", f"{self.qk_norm_type!r} is not one of {QK_NORM_TYPES}")
        if len(self.rope_axes_dims) != 3 or any(d <= 0 or d % 2 for d in self.rope_axes_dims):
            raise self.error("rope_axes_dims", f"needs three positive even sizes, got {list(self.rope_axes_dims)}")
        if sum(self.rope_axes_dims) != self.head_dim:
            raise self.error(
                "rope_axes_dims", f"sum {sum(self.rope_axes_dims)} must equal the head dim {self.head_dim}"
            )


class ViT3DDecoder(nn.Module):
    """Latents ``[B, C, T, h, w]`` → frames ``[B, out_channels, T·pt, h·ph, w·pw]`` (roughly in [-1, 1]).

    Call :meth:`decode`, which sets the forward context the USP attention path needs.
    """

    def __init__(self, config: ViT3DDecoderConfig | None = None) -> None:
        super().__init__()
        config = config if config is not None else ViT3DDecoderConfig()
        if config.t_causal:
            raise ValueError(
                "ViT3DDecoder(t_causal=True) is not supported: the released MiniMax-H3 decoder is non-causal "
                "(causal_decoder=False) and the block-causal mask path had no runtime caller"
            )
        self.config = config
        c = config
        voxel = c.patch_size[0] * c.patch_size[1] * c.patch_size[2]
        self.proj_in = nn.Linear(c.latent_channels, c.hidden_size)
        self.blocks = nn.ModuleList(
            TransformerBlock(c.hidden_size, c.num_heads, c.mlp_ratio, c.qk_norm_type) for _ in range(c.num_layers)
        )
        self.norm_out = nn.LayerNorm(c.hidden_size, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(c.hidden_size, c.out_channels * voxel)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | ViT3DDecoderConfig) -> ViT3DDecoder:
        """Build from a dict (bad keys raise naming the key) or a config."""
        return cls(config if isinstance(config, ViT3DDecoderConfig) else ViT3DDecoderConfig.from_dict(config))

    def load_weights(self, source: str | os.PathLike[str] | Mapping[str, Tensor]) -> list[str]:
        """Load a .safetensors file (or dict) whose names are this module's ``state_dict`` keys."""
        return load_safetensors_into(self, source)

    def attention_dispatches(self) -> list[str | None]:
        """The branch each block's attention took in the last forward (see ``Attention.last_dispatch``)."""
        return [block.attn.last_dispatch for block in self.blocks]

    def decode(self, latents: Tensor) -> Tensor:
        """Decode inside the forward context the attention layers read (as sglang's decoding stage does)."""
        with set_forward_context(current_timestep=0, attn_metadata=None):
            return self(latents)

    def forward(self, latents: Tensor) -> Tensor:
        c = self.config
        if latents.dim() != 5 or latents.shape[1] != c.latent_channels:
            raise ValueError(f"latents must be [B, {c.latent_channels}, T, h, w], got {tuple(latents.shape)}")
        b, _, t, h, w = latents.shape
        dtype = self.proj_in.weight.dtype
        tokens = self.proj_in(latents.to(dtype).flatten(2).transpose(1, 2))  # [B, T*h*w, hidden], (t, h, w) row-major
        rope = axial_rope_cos_sin(grid_positions((t, h, w), device=latents.device), c.rope_axes_dims, c.rope_theta)
        for block in self.blocks:
            tokens = block(tokens, rope)
        pt, ph, pw = c.patch_size
        x = self.proj_out(self.norm_out(tokens)).view(b, t, h, w, c.out_channels, pt, ph, pw)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, c.out_channels, t * pt, h * ph, w * pw)


class CausalAttention(nn.Module):
    """Audio VAE causal self-attention, ``[B, N, in_dim] → [B, N, out_dim]`` (DAC lineage).

    ``supported_attention_backends`` and ``dtype`` default to the released layer (FA or
    TORCH_SDPA, compute dtype chosen by the backend); they are parameters so that the
    cast-and-restore path can be exercised where no fused backend is installed.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        num_heads: int,
        *,
        supported_attention_backends: Iterable[AttentionBackendEnum | str] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if in_dim % num_heads:
            raise ValueError(f"CausalAttention: in_dim {in_dim} is not divisible by num_heads {num_heads}")
        self.in_dim, self.out_dim, self.num_heads = in_dim, out_dim, num_heads
        self.head_dim = in_dim // num_heads
        self.qkv = nn.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(in_dim))
        self.v_bias = nn.Parameter(torch.zeros(in_dim))
        self.register_buffer("zero_k_bias", torch.zeros(in_dim), persistent=False)
        self.proj = nn.Linear(out_dim if in_dim > out_dim else in_dim, out_dim)
        self.attn: USPAttention | None = None
        if current_platform.is_cuda():
            supported = AUDIO_VAE_BACKENDS if supported_attention_backends is None else supported_attention_backends
            with attention_component(AUDIO_VAE_COMPONENT):
                # Audio tiles are encoded rank-locally; TORCH_SDPA keeps the released fp32 contract.
                self.attn = USPAttention(
                    num_heads,
                    self.head_dim,
                    causal=True,
                    supported_attention_backends=supported,
                    default_attention_backend=AttentionBackendEnum.TORCH_SDPA,
                    skip_sequence_parallel=True,
                    dtype=dtype,
                )
        self.last_dispatch: str | None = None

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, _ = x.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        qkv = F.linear(x, self.qkv.weight, bias)
        q, k, v = qkv.reshape(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 1, 3, 4).unbind(0)
        if self.attn is None:
            self.last_dispatch = "sdpa"
            out = _sdpa(q, k, v, causal=True, kernel=None)
        else:
            self.last_dispatch = f"usp:{self.attn.backend.value}"
            input_dtype = q.dtype
            if self.attn.backend != AttentionBackendEnum.TORCH_SDPA:
                # A fused backend sets only the attention's compute precision; callers still get their dtype.
                q, k, v = (t.to(self.attn.dtype) for t in (q, k, v))
            out = self.attn(q, k, v).to(input_dtype)
        if self.in_dim > self.out_dim:
            out = out.mean(dim=2)
            if self.head_dim != self.out_dim:
                out = F.adaptive_avg_pool1d(out, self.out_dim)
        else:
            out = out.reshape(batch, tokens, -1)
        return self.proj(out)
