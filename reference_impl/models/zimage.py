"""Z-Image DiT: attention, transformer block and a small end-to-end stack, sequence-parallel ready.

Token order is *image tokens, then caption tokens*. Under sequence parallelism (SP degree W)
each rank holds ``S_img / W`` image tokens (its contiguous shard, in rank order) followed by
the *whole* caption, and the attention is told ``num_replicated_suffix=caption_len``:
USPAttention keeps the caption at the tail, so every query scans K/V in single-rank order
and the SP output is bitwise equal to one rank (sglang seed 001; rotating the caption to
the front instead gave Z-Image-Turbo a mean abs error of 7.28 over 9 steps), provided the
attention kernel is head-count invariant and the GEMMs row-count invariant (CPU: yes; H200:
bf16 yes except torch's flash kernel at some shapes, fp32 GEMMs no).

RoPE is 3-D axial and interleaved (sglang's ``is_neox_style=False``). Positions follow
Z-Image: caption token ``i`` sits at ``(1 + i, 0, 0)``, image token ``(h, w)`` at
``(cap_len + 1, h, w)``. A shard rotates its tokens by their *global* positions
(:func:`zimage_rope`), which is what makes SP equal single rank.

Attention layers must run inside ``reference_impl.set_forward_context(...)``; the backend is
chosen when the model is built (``attention_backend_config`` / ``attention_component``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from reference_impl.attention.layer import USPAttention
from reference_impl.models.layers import (
    ModelConfig,
    RMSNorm,
    apply_rope,
    axial_rope_cos_sin,
    even_shard_bounds,
    grid_positions,
    load_safetensors_into,
)
from reference_impl.parallel import comm
from reference_impl.parallel.state import get_ring_world_size, get_sp_rank, get_sp_world_size, get_ulysses_group

Tensor = torch.Tensor
Rope = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class ZImageConfig(ModelConfig):
    """Z-Image architecture; the defaults are the released 6B model's sizes, tests pass tiny ones."""

    dim: int = 3840
    num_heads: int = 30
    num_kv_heads: int = 30
    head_dim: int = 128
    ffn_hidden_dim: int = 10240  # SwiGLU width (int(dim / 3 * 8) in Z-Image)
    num_layers: int = 30
    axes_dims: tuple[int, ...] = (32, 48, 48)  # RoPE channels per axis (caption/frame, h, w); sums to head_dim
    rope_theta: float = 256.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    in_channels: int = 16
    patch_size: int = 2
    cap_feat_dim: int = 2560  # text-encoder hidden size
    adaln_embed_dim: int = 256  # timestep embedding width fed to every modulation
    t_embed_mid_dim: int = 1024
    t_freq_dim: int = 256
    t_scale: float = 1000.0  # the timestep is multiplied by this before the sinusoidal embedding

    def validate(self) -> None:
        for key in ("dim", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_dim", "in_channels", "patch_size",
                    "cap_feat_dim", "adaln_embed_dim", "t_embed_mid_dim", "t_freq_dim"):
            if getattr(self, key) <= 0:
                raise self.error(key, f"must be positive, got {getattr(self, key)}")
        if self.num_layers < 0:
            raise self.error("num_layers", f"must be >= 0, got {self.num_layers}")
        if self.num_heads % self.num_kv_heads:
            raise self.error("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.t_freq_dim % 2:
            raise self.error("t_freq_dim", f"must be even, got {self.t_freq_dim}")
        if any(d <= 0 or d % 2 for d in self.axes_dims):
            raise self.error("axes_dims", f"every axis needs a positive even channel count, got {list(self.axes_dims)}")
        if sum(self.axes_dims) != self.head_dim:
            raise self.error("axes_dims", f"sum {sum(self.axes_dims)} must equal head_dim={self.head_dim}")


# ---------------------------------------------------------------------------- RoPE and sharding
def zimage_positions(grid_hw: tuple[int, int], cap_len: int, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """Global 3-axis positions: image ``[H*W, 3]`` (row-major) and caption ``[cap_len, 3]``."""
    h, w = grid_hw
    img = grid_positions((1, h, w), (cap_len + 1, 0, 0), device)
    cap = grid_positions((cap_len, 1, 1), (1, 0, 0), device)
    return img, cap


def zimage_rope(config: ZImageConfig, grid_hw: tuple[int, int], cap_len: int, rank: int = 0, world: int = 1,
                device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Rope:
    """cos/sin ``[S_img/world + cap_len, head_dim/2]`` for rank ``rank``'s image shard then the whole caption.

    With ``world=1`` this is the full single-rank table; a shard gets the rows of its global positions.
    """
    img, cap = zimage_positions(grid_hw, cap_len, device)
    start, end = even_shard_bounds(img.shape[0], rank, world)
    return axial_rope_cos_sin(torch.cat([img[start:end], cap]), config.axes_dims, config.rope_theta, dtype)


# ---------------------------------------------------------------------------- layers
class ZImageAttention(nn.Module):
    """Fused QKV → per-head RMSNorm on q and k → RoPE → USPAttention → output projection."""

    def __init__(self, config: ZImageConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv = nn.Linear(config.dim, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim, bias=False)
        self.norm_q = RMSNorm(config.head_dim, eps=config.qk_norm_eps)
        self.norm_k = RMSNorm(config.head_dim, eps=config.qk_norm_eps)
        self.attn = USPAttention(config.num_heads, config.head_dim, num_kv_heads=config.num_kv_heads)
        self.out = nn.Linear(config.num_heads * config.head_dim, config.dim, bias=False)

    def forward(self, hidden: Tensor, rope: Rope, num_replicated_suffix: int = 0, num_replicated_prefix: int = 0) -> Tensor:
        """``hidden [B, S_local, dim]``, ``rope`` tables ``[S_local, head_dim/2]`` → ``[B, S_local, dim]``.

        ``num_replicated_suffix``: the trailing tokens identical on every SP rank (the caption).
        ``num_replicated_prefix`` is the same for leading tokens: a caption rotated to the front
        (sglang's old layout), kept so contracts can measure the drift that order costs.
        """
        b, s, _ = hidden.shape
        q, k, v = self.qkv(hidden).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1
        )
        q = self.norm_q(q.view(b, s, self.num_heads, self.head_dim))
        k = self.norm_k(k.view(b, s, self.num_kv_heads, self.head_dim))
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attn(q, k, v, num_replicated_prefix=num_replicated_prefix, num_replicated_suffix=num_replicated_suffix)
        return self.out(out.reshape(b, s, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """``w2(silu(x W1) * x W3)`` with W1 and W3 fused into one matmul."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class ZImageTransformerBlock(nn.Module):
    """Sandwich-norm block with adaLN modulation from the timestep embedding.

    ``x += tanh(g_a) · norm(attn(norm(x) · (1 + s_a)))``, then the same with the SwiGLU FFN;
    ``(s_a, g_a, s_f, g_f)`` come from one linear on the timestep embedding.
    """

    def __init__(self, config: ZImageConfig) -> None:
        super().__init__()
        self.attention = ZImageAttention(config)
        self.feed_forward = SwiGLU(config.dim, config.ffn_hidden_dim)
        self.attention_norm1 = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention_norm2 = RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm1 = RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm2 = RMSNorm(config.dim, eps=config.norm_eps)
        self.adaln_modulation = nn.Linear(config.adaln_embed_dim, 4 * config.dim)

    def forward(self, hidden: Tensor, rope: Rope, adaln_input: Tensor, num_replicated_suffix: int = 0,
                num_replicated_prefix: int = 0) -> Tensor:
        """``hidden [B, S_local, dim]`` (image shard + caption), ``adaln_input [B, adaln_embed_dim]``."""
        scale_a, gate_a, scale_f, gate_f = self.adaln_modulation(adaln_input).unsqueeze(1).chunk(4, dim=-1)
        attn = self.attention(self.attention_norm1(hidden) * (1 + scale_a), rope, num_replicated_suffix, num_replicated_prefix)
        hidden = hidden + gate_a.tanh() * self.attention_norm2(attn)
        ffn = self.feed_forward(self.ffn_norm1(hidden) * (1 + scale_f))
        return hidden + gate_f.tanh() * self.ffn_norm2(ffn)


class TimestepEmbedder(nn.Module):
    """Sinusoidal embedding (cos then sin, fp32) of ``t · t_scale`` → MLP."""

    def __init__(self, config: ZImageConfig) -> None:
        super().__init__()
        self.freq_dim, self.t_scale = config.t_freq_dim, config.t_scale
        self.mlp = nn.Sequential(
            nn.Linear(config.t_freq_dim, config.t_embed_mid_dim), nn.SiLU(), nn.Linear(config.t_embed_mid_dim, config.adaln_embed_dim)
        )

    def forward(self, t: Tensor) -> Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = (t.float() * self.t_scale)[:, None] * freqs[None]
        emb = torch.cat([args.cos(), args.sin()], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class FinalLayer(nn.Module):
    """Affine-free LayerNorm scaled by ``1 + linear(silu(t_emb))``, then the patch projection."""

    def __init__(self, config: ZImageConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.dim, elementwise_affine=False, eps=1e-6)
        self.adaln_modulation = nn.Linear(config.adaln_embed_dim, config.dim)
        self.linear = nn.Linear(config.dim, config.patch_size**2 * config.in_channels)

    def forward(self, x: Tensor, adaln_input: Tensor) -> Tensor:
        scale = self.adaln_modulation(F.silu(adaln_input)).unsqueeze(1)
        return self.linear(self.norm(x) * (1 + scale))


# ---------------------------------------------------------------------------- the stack
class ZImageDiT(nn.Module):
    """patch embed → ``num_layers`` blocks over [image | caption] → final layer → unpatchify.

    One rank or sequence parallel: ``forward`` reads the SP degree from
    ``reference_impl.parallel.state``; with W > 1 each rank embeds the whole latent, keeps its
    image shard plus the full caption, runs the blocks with the caption as the replicated
    suffix and all-gathers the image tokens at the end, so every rank returns the full output
    (bitwise equal to one rank). Needs ring degree 1 and ``H/p · W/p`` divisible by W.
    """

    def __init__(self, config: ZImageConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.t_embedder = TimestepEmbedder(c)
        self.x_embedder = nn.Linear(c.patch_size**2 * c.in_channels, c.dim)
        self.cap_embedder = nn.Sequential(RMSNorm(c.cap_feat_dim, eps=c.norm_eps), nn.Linear(c.cap_feat_dim, c.dim))
        self.layers = nn.ModuleList(ZImageTransformerBlock(c) for _ in range(c.num_layers))
        self.final_layer = FinalLayer(c)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | ZImageConfig) -> ZImageDiT:
        """Build from a dict (keys of :class:`ZImageConfig`; bad keys raise naming the key) or a config."""
        return cls(config if isinstance(config, ZImageConfig) else ZImageConfig.from_dict(config))

    def load_weights(self, source: str | os.PathLike[str] | Mapping[str, Tensor]) -> list[str]:
        """Load a .safetensors file (or dict) whose names are this module's ``state_dict`` keys."""
        return load_safetensors_into(self, source)

    def _patchify(self, latents: Tensor) -> Tensor:
        b, c, h, w = latents.shape
        p = self.config.patch_size
        x = latents.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)  # b, h', w', ph, pw, c
        return x.reshape(b, (h // p) * (w // p), p * p * c)

    def _unpatchify(self, x: Tensor, h: int, w: int) -> Tensor:
        b, p, c = x.shape[0], self.config.patch_size, self.config.in_channels
        x = x.view(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4)  # b, c, h', ph, w', pw
        return x.reshape(b, c, h, w)

    def forward(self, latents: Tensor, timestep: Tensor | float, caption_embeds: Tensor) -> Tensor:
        """``latents [B, C, H, W]``, ``timestep`` scalar or ``[B]``, ``caption_embeds [B, S_cap, cap_feat_dim]``.

        Returns the prediction ``[B, C, H, W]`` in ``latents``' dtype (computed in the weights' dtype).
        """
        c = self.config
        b, ch, h, w = latents.shape
        if ch != c.in_channels or h % c.patch_size or w % c.patch_size:
            raise ValueError(
                f"latents {tuple(latents.shape)} need {c.in_channels} channels and H, W divisible by patch_size={c.patch_size}"
            )
        if caption_embeds.dim() != 3 or caption_embeds.shape[0] != b or caption_embeds.shape[2] != c.cap_feat_dim:
            raise ValueError(f"caption_embeds must be [{b}, S_cap, {c.cap_feat_dim}], got {tuple(caption_embeds.shape)}")
        dtype = self.x_embedder.weight.dtype
        t = torch.as_tensor(timestep, dtype=torch.float32, device=latents.device).reshape(-1).expand(b)
        adaln = self.t_embedder(t)

        world, rank = get_sp_world_size(), get_sp_rank()
        if world > 1 and get_ring_world_size() > 1:
            raise NotImplementedError("ZImageDiT shards image tokens over Ulysses only: the caption suffix path has no ring support")
        grid = (h // c.patch_size, w // c.patch_size)
        start, end = even_shard_bounds(grid[0] * grid[1], rank, world)
        img = self.x_embedder(self._patchify(latents.to(dtype)))[:, start:end]
        cap = self.cap_embedder(caption_embeds.to(dtype))
        cap_len = cap.shape[1]
        rope = zimage_rope(c, grid, cap_len, rank, world, latents.device, torch.promote_types(dtype, torch.float32))

        hidden = torch.cat([img, cap], dim=1)
        for layer in self.layers:
            hidden = layer(hidden, rope, adaln, num_replicated_suffix=cap_len)
        out = self.final_layer(hidden[:, : end - start], adaln)
        if world > 1:
            out = comm.all_gather(out, dim=1, group=get_ulysses_group())
        return self._unpatchify(out, h, w).to(latents.dtype)
