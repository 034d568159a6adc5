"""Z-Image transformer blocks as diffusers 0.42.1 computes them (``transformer_z_image.py``).

Parameter names are diffusers' (``attention.to_q``, ``feed_forward.w1``, ``adaLN_modulation.0`` ...), so a
diffusers state dict loads as it is; the model around the blocks (padding, refiners, sequence parallelism) is
:mod:`reference_impl.models.zimage_transformer`. :class:`ZImageConfig` has diffusers' config keys and defaults
(the released 6B model), the sizes diffusers derives from them as properties. RoPE is 3-D axial and interleaved,
its table rounded where diffusers rounds it and applied as a complex64 multiply (:func:`apply_rope_complex`).
:class:`ZImageAttention`: ``to_q``/``to_k``/``to_v`` → per-head RMSNorm on q and k → RoPE → USPAttention →
``to_out``; the caption refiner's runs rank-locally (every rank holds the whole caption). Attention layers must
run inside ``reference_impl.set_forward_context(...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from reference_impl.attention.layer import USPAttention
from reference_impl.models.layers import (
    ModelConfig,
    RMSNorm,
    apply_rope_complex,
    axial_rope_cos_sin,
    timestep_embedding,
)

Tensor = torch.Tensor
Rope = tuple[Tensor, Tensor]

ADALN_EMBED_DIM = 256  # diffusers' fixed widths: the adaLN input is min(dim, 256) wide
T_EMBED_MID_DIM = 1024
T_FREQ_DIM = 256
QK_NORM_EPS = 1e-5  # diffusers fixes the q/k norm eps; norm_eps is the block norms'
FINAL_NORM_EPS = 1e-6


@dataclass(frozen=True)
class ZImageConfig(ModelConfig):
    """``ZImageTransformer2DModel``'s config keys; defaults are the released model's.

    ``n_kv_heads`` is read and unused, as in diffusers 0.42.1 (its attention is built with
    ``n_heads`` key/value heads). ``siglip_feat_dim`` (the Omni variant) is not implemented.
    """

    all_patch_size: tuple[int, ...] = (2,)
    all_f_patch_size: tuple[int, ...] = (1,)
    in_channels: int = 16
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    n_kv_heads: int = 30
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560
    siglip_feat_dim: int | None = None
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)
    axes_lens: tuple[int, ...] = (1024, 512, 512)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return int(self.dim / 3 * 8)

    @property
    def adaln_embed_dim(self) -> int:
        return min(self.dim, ADALN_EMBED_DIM)

    def validate(self) -> None:
        for key in ("in_channels", "dim", "n_heads", "cap_feat_dim"):
            if getattr(self, key) <= 0:
                raise self.error(key, f"must be positive, got {getattr(self, key)}")
        for key in ("n_layers", "n_refiner_layers"):
            if getattr(self, key) < 0:
                raise self.error(key, f"must be >= 0, got {getattr(self, key)}")
        if self.dim % self.n_heads:
            raise self.error("n_heads", f"{self.n_heads} does not divide dim={self.dim}")
        if self.siglip_feat_dim is not None:
            raise self.error("siglip_feat_dim", "the Omni variant (SigLIP features) is not implemented; must be null")
        if not self.all_patch_size or len(self.all_patch_size) != len(self.all_f_patch_size):
            raise self.error(
                "all_f_patch_size", f"needs one entry per all_patch_size entry {list(self.all_patch_size)}"
            )
        if min(self.all_patch_size + self.all_f_patch_size) <= 0:
            raise self.error("all_patch_size", "patch sizes must be positive")
        if len(self.axes_dims) != 3 or any(d <= 0 or d % 2 for d in self.axes_dims):
            raise self.error("axes_dims", f"needs 3 positive even channel counts, got {list(self.axes_dims)}")
        if sum(self.axes_dims) != self.head_dim:
            raise self.error(
                "axes_dims", f"sum {sum(self.axes_dims)} must equal the head dim dim/n_heads={self.head_dim}"
            )
        if len(self.axes_lens) != 3 or min(self.axes_lens) <= 0:
            raise self.error("axes_lens", f"needs 3 positive table lengths, got {list(self.axes_lens)}")


def zimage_rope(config: ZImageConfig, positions: Tensor, dtype: torch.dtype = torch.float32) -> Rope:
    """cos/sin ``[S, head_dim/2]`` of 3-axis positions ``[S, 3]``, rounded as diffusers rounds them.

    Diffusers looks positions up in a table of ``axes_lens`` rows per axis, so a position past
    it is an error there; it is one here too, rather than a silent extrapolation.
    """
    for axis, limit in enumerate(config.axes_lens):
        if positions.shape[0] and int(positions[:, axis].max()) >= limit:
            raise ValueError(
                f"RoPE position {int(positions[:, axis].max())} on axis {axis} is past axes_lens[{axis}]={limit}"
            )
    return axial_rope_cos_sin(positions, config.axes_dims, config.rope_theta, dtype, rounding="fp32_angles")


# ---------------------------------------------------------------------------- layers
class ZImageAttention(nn.Module):
    """Self-attention with per-head q/k RMSNorm and RoPE; ``local=True`` never shards (replicated tokens)."""

    def __init__(self, config: ZImageConfig, local: bool = False, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.heads, self.head_dim = config.n_heads, config.head_dim
        inner = config.n_heads * config.head_dim
        self.to_q = nn.Linear(config.dim, inner, bias=False)
        self.to_k = nn.Linear(config.dim, inner, bias=False)
        self.to_v = nn.Linear(config.dim, inner, bias=False)
        self.norm_q = RMSNorm(config.head_dim, eps=QK_NORM_EPS) if config.qk_norm else None
        self.norm_k = RMSNorm(config.head_dim, eps=QK_NORM_EPS) if config.qk_norm else None
        self.to_out = nn.ModuleList([nn.Linear(inner, config.dim, bias=False)])
        self.attn = USPAttention(config.n_heads, config.head_dim, skip_sequence_parallel=local, dtype=compute_dtype)

    def forward(
        self,
        hidden: Tensor,
        rope: Rope,
        attn_mask: Tensor | None = None,
        num_replicated_suffix: int = 0,
        num_replicated_prefix: int = 0,
    ) -> Tensor:
        """``hidden [B, S_local, dim]``, ``rope`` tables ``[S_local, head_dim/2]`` or ``[B, S_local, head_dim/2]``.

        ``attn_mask [B, S_local]``: key padding (True = attend). ``num_replicated_suffix``: the
        trailing tokens identical on every SP rank (the caption); ``num_replicated_prefix`` the
        same for leading tokens (a caption rotated to the front, sglang's old layout, kept so
        contracts can measure the drift that order costs).
        """
        b, s, _ = hidden.shape
        q, k, v = (proj(hidden).view(b, s, self.heads, self.head_dim) for proj in (self.to_q, self.to_k, self.to_v))
        if self.norm_q is not None and self.norm_k is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k = apply_rope_complex(q, *rope), apply_rope_complex(k, *rope)
        out = self.attn(
            q,
            k,
            v,
            attn_mask=attn_mask,
            num_replicated_prefix=num_replicated_prefix,
            num_replicated_suffix=num_replicated_suffix,
        )
        return self.to_out[0](out.reshape(b, s, self.heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) · w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ZImageTransformerBlock(nn.Module):
    """Sandwich-norm block; with ``modulation`` the timestep scales its inputs and tanh-gates its outputs.

    ``x += tanh(g_a) · norm(attn(norm(x) · (1 + s_a)))``, then the same with the SwiGLU FFN;
    ``(s_a, g_a, s_f, g_f)`` come from one linear on the adaLN input. Without modulation (the
    caption refiner) scales are 1 and gates are 1.
    """

    def __init__(
        self,
        config: ZImageConfig,
        modulation: bool = True,
        local: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.attention = ZImageAttention(config, local=local, compute_dtype=compute_dtype)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)
        self.attention_norm1 = RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm1 = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention_norm2 = RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm2 = RMSNorm(config.dim, eps=config.norm_eps)
        self.adaLN_modulation = nn.Sequential(nn.Linear(config.adaln_embed_dim, 4 * config.dim)) if modulation else None

    def forward(
        self,
        hidden: Tensor,
        rope: Rope,
        adaln_input: Tensor | None = None,
        attn_mask: Tensor | None = None,
        num_replicated_suffix: int = 0,
        num_replicated_prefix: int = 0,
    ) -> Tensor:
        """``hidden [B, S_local, dim]``; ``adaln_input [B, adaln_embed_dim]`` iff the block is modulated."""
        if (self.adaLN_modulation is None) != (adaln_input is None):
            raise ValueError("a modulated block needs adaln_input, an unmodulated one takes none")
        replicated = {"num_replicated_suffix": num_replicated_suffix, "num_replicated_prefix": num_replicated_prefix}
        if self.adaLN_modulation is None:
            attn = self.attention(self.attention_norm1(hidden), rope, attn_mask, **replicated)
            hidden = hidden + self.attention_norm2(attn)
            return hidden + self.ffn_norm2(self.feed_forward(self.ffn_norm1(hidden)))
        scale_a, gate_a, scale_f, gate_f = self.adaLN_modulation(adaln_input).unsqueeze(1).chunk(4, dim=2)
        attn = self.attention(self.attention_norm1(hidden) * (1.0 + scale_a), rope, attn_mask, **replicated)
        hidden = hidden + gate_a.tanh() * self.attention_norm2(attn)
        ffn = self.feed_forward(self.ffn_norm1(hidden) * (1.0 + scale_f))
        return hidden + gate_f.tanh() * self.ffn_norm2(ffn)


class TimestepEmbedder(nn.Module):
    """Sinusoidal embedding (cos then sin, fp32) → ``Linear(256, 1024)`` → SiLU → ``Linear(1024, adaln)``."""

    def __init__(self, config: ZImageConfig) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(T_FREQ_DIM, T_EMBED_MID_DIM), nn.SiLU(), nn.Linear(T_EMBED_MID_DIM, config.adaln_embed_dim)
        )

    def forward(self, t: Tensor) -> Tensor:
        """``t [B]``, already multiplied by ``t_scale`` (as diffusers' caller does)."""
        return self.mlp(timestep_embedding(t, T_FREQ_DIM).to(self.mlp[0].weight.dtype))


class FinalLayer(nn.Module):
    """Affine-free LayerNorm scaled by ``1 + linear(silu(adaln))``, then the patch projection."""

    def __init__(self, config: ZImageConfig, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(config.dim, elementwise_affine=False, eps=FINAL_NORM_EPS)
        self.linear = nn.Linear(config.dim, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(config.adaln_embed_dim, config.dim))

    def forward(self, x: Tensor, adaln_input: Tensor) -> Tensor:
        scale = 1.0 + self.adaLN_modulation(adaln_input)
        return self.linear(self.norm_final(x) * scale.unsqueeze(1))
