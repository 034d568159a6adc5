"""HunyuanVideo double- and single-stream blocks as diffusers 0.42.1 computes them, through USPAttention.

Parameter names are diffusers', so a diffusers state dict loads as it is; the model around the blocks is
:mod:`reference_impl.models.hunyuanvideo_transformer`. Both blocks attend over one joint sequence
*[image tokens | text tokens]* and get back ONE tensor from the attention (sglang seed 001). Under sequence
parallelism (degree W, ring 1) the text is replicated (the default: the order-preserving suffix, bitwise),
sharded (``txt_is_sharded=True``: ``seq_lens`` varlen, keys reordered, the FlashAttention rule) or masked
(``attn_mask [B, S_local]``: the joint sequence sharded contiguously with its key mask, bitwise); docs/models.md,
"Under sequence parallelism", has each layout. Image tokens get 3-D axial RoPE (interleaved, the table in fp32
as diffusers computes it) at their global positions, text tokens none. Needs ``set_forward_context(...)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
)

Tensor = torch.Tensor
Rope = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class HunyuanVideoBlockConfig(ModelConfig):
    """Sizes shared by both block kinds; defaults are HunyuanVideo's (hidden 3072, 24 heads)."""

    hidden_size: int = 3072
    num_heads: int = 24
    mlp_ratio: float = 4.0
    rope_axes_dim: tuple[int, ...] = (16, 56, 56)  # RoPE channels for (t, h, w); sums to the head dim
    rope_theta: float = 256.0
    qk_norm_eps: float = 1e-6
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    def validate(self) -> None:
        if self.hidden_size <= 0 or self.num_heads <= 0:
            raise self.error("hidden_size" if self.hidden_size <= 0 else "num_heads", "must be positive")
        if self.hidden_size % self.num_heads:
            raise self.error("num_heads", f"{self.num_heads} does not divide hidden_size={self.hidden_size}")
        if self.mlp_ratio <= 0:
            raise self.error("mlp_ratio", f"must be positive, got {self.mlp_ratio}")
        if any(d <= 0 or d % 2 for d in self.rope_axes_dim):
            raise self.error(
                "rope_axes_dim", f"every axis needs a positive even channel count, got {list(self.rope_axes_dim)}"
            )
        if sum(self.rope_axes_dim) != self.head_dim:
            raise self.error("rope_axes_dim", f"sum {sum(self.rope_axes_dim)} must equal the head dim {self.head_dim}")


# ---------------------------------------------------------------------------- layouts
def hunyuan_rope(
    config: HunyuanVideoBlockConfig,
    grid_thw: tuple[int, int, int],
    rank: int = 0,
    world: int = 1,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Rope:
    """cos/sin ``[T*H*W / world, head_dim/2]`` for rank ``rank``'s image shard, at its global (t, h, w)."""
    pos = grid_positions(grid_thw, device=device)
    start, end = even_shard_bounds(pos.shape[0], rank, world)
    return axial_rope_cos_sin(pos[start:end], config.rope_axes_dim, config.rope_theta, dtype, rounding="fp32")


def shard_text(txt: Tensor, rank: int, world: int) -> tuple[Tensor, list[int]]:
    """Rank ``rank``'s slice of ``txt [B, T, ...]`` zero-padded to ``ceil(T / world)``, and every rank's valid count.

    Rank r holds tokens ``[r·c, min((r+1)·c, T))`` with ``c = ceil(T / world)``; the valid
    counts are what the blocks take as ``txt_valid_lens``.
    """
    total = txt.shape[1]
    chunk = math.ceil(total / world)
    valid = [max(0, min(chunk, total - r * chunk)) for r in range(world)]
    mine = txt[:, rank * chunk : rank * chunk + valid[rank]]
    pad = txt.new_zeros(txt.shape[0], chunk - valid[rank], *txt.shape[2:])
    return torch.cat([mine, pad], dim=1), valid


def _joint_attention(
    attn: USPAttention,
    img_qkv: Sequence[Tensor],
    txt_qkv: Sequence[Tensor],
    attn_mask: Tensor | None,
    txt_is_sharded: bool,
    txt_valid_lens: Sequence[int] | None,
) -> Tensor:
    """Attention over [image | text] in one of the three text layouts; one ``[B, S, H, D]`` tensor."""
    img_len, txt_len = img_qkv[0].shape[1], txt_qkv[0].shape[1]
    q, k, v = (torch.cat([i, t], dim=1) for i, t in zip(img_qkv, txt_qkv))
    if txt_valid_lens is not None and not txt_is_sharded:
        raise ValueError("txt_valid_lens is only meaningful with txt_is_sharded=True")
    if attn_mask is not None:
        # Masked (True = attend; per-item text padding): USPAttention refuses a mask with replicated tokens and
        # seq_lens takes one length per rank, not per item, so the joint [image | text] sequence is sharded
        # contiguously (a rank may hold image tokens only, text only, or both) and the key mask gathered with it:
        # single-rank key order, so bitwise.
        if txt_is_sharded:
            raise ValueError(
                "attn_mask cannot be combined with txt_is_sharded: the seq_lens (varlen) path takes no mask"
            )
        return attn(q, k, v, attn_mask=attn_mask)
    if not txt_is_sharded:
        # Replicated: every rank holds its contiguous S_img / W image tokens and the whole text as the suffix;
        # order-preserving, so bitwise given row-count-invariant GEMMs (see harness.targets.reference.models).
        return attn(q, k, v, num_replicated_suffix=txt_len)
    if txt_valid_lens is None:
        raise ValueError("txt_is_sharded=True needs txt_valid_lens (valid text tokens on every rank; see shard_text)")
    if any(n < 0 or n > txt_len for n in txt_valid_lens):
        raise ValueError(
            f"txt_valid_lens {list(txt_valid_lens)} must each be in [0, {txt_len}] (the local padded text length)"
        )
    # Sharded: rank r holds its slice of the text padded to a common length (shard_text), txt_valid_lens[r] of it
    # valid; keys are scanned [img_0, txt_0, img_1, txt_1, ...], a reordering of the single-rank keys, so this equals
    # one rank only up to rounding (the FlashAttention rule). Outputs at padded text positions are meaningless.
    return attn(q, k, v, seq_lens=[img_len + int(n) for n in txt_valid_lens])


# ---------------------------------------------------------------------------- pieces
def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu_tanh": _gelu_tanh, "silu": F.silu}


class _ProjectIn(nn.Module):
    """diffusers' ``GELU`` / ``LinearActivation``: the input projection, then its activation."""

    def __init__(self, dim: int, inner: int, activation: str) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.activation(self.proj(x))


class FeedForward(nn.Module):
    """diffusers' ``FeedForward`` (``net.0.proj`` → activation → ``net.2``; ``net.1`` is its dropout)."""

    def __init__(self, dim: int, inner: int, activation: str = "gelu_tanh") -> None:
        super().__init__()
        self.net = nn.ModuleList([_ProjectIn(dim, inner, activation), nn.Identity(), nn.Linear(inner, dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](self.net[0](x))


class AdaNormZero(nn.Module):
    """``linear(silu(vec))`` in ``chunks`` pieces; ``LayerNorm(x)·(1 + scale) + shift`` with the first two.

    diffusers' ``AdaLayerNormZero`` (6 chunks) and ``AdaLayerNormZeroSingle`` (3); returns the
    modulated x and the remaining chunks (gates, MLP shift/scale).
    """

    def __init__(self, hidden_size: int, chunks: int, eps: float) -> None:
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(hidden_size, chunks * hidden_size)
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=eps)

    def forward(self, x: Tensor, vec: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        shift, scale, *rest = self.linear(F.silu(vec)).chunk(self.chunks, dim=1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None], tuple(rest)


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class HunyuanAttention(nn.Module):
    """``to_q``/``to_k``/``to_v`` (biased) → optional per-head RMSNorm → USPAttention, diffusers' names.

    ``project_out`` adds ``to_out.0``; ``local=True`` never shards (the token refiner, on the
    replicated text).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        qk_norm_eps: float | None,
        project_out: bool,
        local: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.heads = num_heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(hidden_size, hidden_size) for _ in range(3))
        head_dim = hidden_size // num_heads
        self.norm_q = RMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None
        self.norm_k = RMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None
        self.to_out = nn.ModuleList([nn.Linear(hidden_size, hidden_size)]) if project_out else None
        self.attn = USPAttention(num_heads, head_dim, skip_sequence_parallel=local, dtype=compute_dtype)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = (proj(x).unflatten(2, (self.heads, -1)) for proj in (self.to_q, self.to_k, self.to_v))
        if self.norm_q is not None and self.norm_k is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        return q, k, v


class JointAttention(HunyuanAttention):
    """The double-stream block's attention: image projections plus the text's ``add_*`` ones."""

    def __init__(self, config: HunyuanVideoBlockConfig, compute_dtype: torch.dtype | None = None) -> None:
        h = config.hidden_size
        super().__init__(h, config.num_heads, config.qk_norm_eps, project_out=True, compute_dtype=compute_dtype)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(h, h) for _ in range(3))
        self.norm_added_q = RMSNorm(config.head_dim, eps=config.qk_norm_eps)
        self.norm_added_k = RMSNorm(config.head_dim, eps=config.qk_norm_eps)
        self.to_add_out = nn.Linear(h, h)

    def forward(
        self,
        img: Tensor,
        txt: Tensor,
        rope: Rope,
        attn_mask: Tensor | None,
        txt_is_sharded: bool,
        txt_valid_lens: Sequence[int] | None,
    ) -> tuple[Tensor, Tensor]:
        q, k, v = self.qkv(img)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        tq, tk, tv = (
            proj(txt).unflatten(2, (self.heads, -1)) for proj in (self.add_q_proj, self.add_k_proj, self.add_v_proj)
        )
        tq, tk = self.norm_added_q(tq), self.norm_added_k(tk)
        out = _joint_attention(self.attn, (q, k, v), (tq, tk, tv), attn_mask, txt_is_sharded, txt_valid_lens).flatten(2)
        img_out, txt_out = out.split([img.shape[1], txt.shape[1]], dim=1)
        assert self.to_out is not None
        return _output_projection(self.to_out[0], img_out), _output_projection(self.to_add_out, txt_out)


def _output_projection(linear: nn.Linear, x: Tensor) -> Tensor:
    """``linear(x)`` rounded as diffusers' ``to_out`` / ``to_add_out`` on its slice of the joint output.

    torch's linear fuses the bias into the GEMM (one bf16 rounding) only for contiguous 3-D
    input. Diffusers' slices are contiguous for one item and strided for more (GEMM rounded,
    then the bias added), so the choice follows the batch size, never the layout: in the masked
    SP layout a rank's split can be the whole tensor where another rank's is a view.
    """
    x = x.contiguous()
    if x.shape[0] == 1 or linear.bias is None:
        return linear(x)
    return F.linear(x, linear.weight) + linear.bias


# ---------------------------------------------------------------------------- blocks
class MMDoubleStreamBlock(nn.Module):
    """Separate weights for image and text, one joint attention over [image | text] (``HunyuanVideoTransformerBlock``).

    ``forward(img [B, S_img_local, hidden], txt [B, S_txt_local, hidden], vec [B, hidden],
    rope (image tables [S_img_local, head_dim/2]), *, attn_mask=None, txt_is_sharded=False,
    txt_valid_lens=None)`` returns ``(img, txt)`` of the input shapes.
    """

    def __init__(self, config: HunyuanVideoBlockConfig, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        h, m = config.hidden_size, config.mlp_hidden_dim
        self.norm1 = AdaNormZero(h, 6, config.norm_eps)
        self.norm1_context = AdaNormZero(h, 6, config.norm_eps)
        self.attn = JointAttention(config, compute_dtype)
        self.norm2 = nn.LayerNorm(h, elementwise_affine=False, eps=config.norm_eps)
        self.ff = FeedForward(h, m)
        self.norm2_context = nn.LayerNorm(h, elementwise_affine=False, eps=config.norm_eps)
        self.ff_context = FeedForward(h, m)

    def forward(
        self,
        img: Tensor,
        txt: Tensor,
        vec: Tensor,
        rope: Rope,
        *,
        attn_mask: Tensor | None = None,
        txt_is_sharded: bool = False,
        txt_valid_lens: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        norm_img, (gate, shift_mlp, scale_mlp, gate_mlp) = self.norm1(img, vec)
        norm_txt, (c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp) = self.norm1_context(txt, vec)
        img_attn, txt_attn = self.attn(norm_img, norm_txt, rope, attn_mask, txt_is_sharded, txt_valid_lens)
        img = img + img_attn * gate.unsqueeze(1)
        txt = txt + txt_attn * c_gate.unsqueeze(1)
        img = img + gate_mlp.unsqueeze(1) * self.ff(_modulate(self.norm2(img), shift_mlp, scale_mlp))
        txt = txt + c_gate_mlp.unsqueeze(1) * self.ff_context(
            _modulate(self.norm2_context(txt), c_shift_mlp, c_scale_mlp)
        )
        return img, txt


class MMSingleStreamBlock(nn.Module):
    """Shared weights over the concatenated [image | text]; attention and MLP in parallel (``HunyuanVideoSingleTransformerBlock``).

    ``forward(x [B, S_img_local + txt_len, hidden], vec [B, hidden], txt_len, rope (image
    tables [S_img_local, head_dim/2]), *, attn_mask=None, txt_is_sharded=False,
    txt_valid_lens=None)`` returns ``x``'s shape. ``txt_len`` is the local text length (padded,
    when sharded; it may be 0 or all of ``x`` in the masked layout).
    """

    def __init__(self, config: HunyuanVideoBlockConfig, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        h, m = config.hidden_size, config.mlp_hidden_dim
        self.attn = HunyuanAttention(
            h, config.num_heads, config.qk_norm_eps, project_out=False, compute_dtype=compute_dtype
        )
        self.norm = AdaNormZero(h, 3, config.norm_eps)
        self.proj_mlp = nn.Linear(h, m)
        self.proj_out = nn.Linear(h + m, h)

    def forward(
        self,
        x: Tensor,
        vec: Tensor,
        txt_len: int,
        rope: Rope,
        *,
        attn_mask: Tensor | None = None,
        txt_is_sharded: bool = False,
        txt_valid_lens: Sequence[int] | None = None,
    ) -> Tensor:
        s = x.shape[1]
        if not 0 <= txt_len <= s:
            raise ValueError(f"txt_len={txt_len} must be in [0, {s}] for a joint sequence of {s} tokens")
        norm_x, (gate,) = self.norm(x, vec)
        mlp = _gelu_tanh(self.proj_mlp(norm_x))
        q, k, v = self.attn.qkv(norm_x)
        img_len = s - txt_len
        img_q, img_k = apply_rope(q[:, :img_len], *rope), apply_rope(k[:, :img_len], *rope)
        attn = _joint_attention(
            self.attn.attn,
            (img_q, img_k, v[:, :img_len]),
            (q[:, img_len:], k[:, img_len:], v[:, img_len:]),
            attn_mask,
            txt_is_sharded,
            txt_valid_lens,
        )
        # The joint output is already in [image | text] order, which is proj_out's input order.
        return x + gate.unsqueeze(1) * self.proj_out(torch.cat([attn.flatten(2), mlp], dim=2))
