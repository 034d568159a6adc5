"""HunyuanVideo MMDoubleStreamBlock and MMSingleStreamBlock through USPAttention.

Both blocks attend over one joint sequence *[image tokens | text tokens]* and get back ONE
tensor from the attention (sglang seed 001): the double-stream block splits it with
``.split([img_len, txt_len], dim=1)`` for its two streams; the single-stream block feeds it
whole to ``linear2``, whose input order it already is. Under sequence parallelism (degree W, ring degree 1) image tokens are
always sharded (rank r holds its contiguous ``S_img / W`` tokens); text comes in one of two
layouts:

- replicated (``txt_is_sharded=False``, the default): every rank holds the whole text, passed
  to the attention as ``num_replicated_suffix=txt_len``. Order-preserving, so the SP output
  is bitwise equal to one rank (given row-count-invariant GEMMs; see harness.contracts.model_parity).
- sharded (``txt_is_sharded=True``): rank r holds its slice of the text padded to a common
  length (:func:`shard_text`), with ``txt_valid_lens[r]`` valid tokens. The attention runs
  the ``seq_lens`` varlen path with ``seq_lens[r] = img_local + txt_valid_lens[r]``; the
  joint sequence is then scanned as ``[img_0, txt_0, img_1, txt_1, ...]``, a reordering of
  the single-rank keys, so the result equals one rank only up to rounding. Outputs at padded
  text positions are meaningless and must be dropped by the caller.

Image tokens are rotated by 3-D axial RoPE (interleaved) at their global positions
(:func:`hunyuan_rope`); text tokens get no RoPE. Blocks need
``reference_impl.set_forward_context(...)`` around the call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from reference_impl.attention.layer import USPAttention
from reference_impl.models.layers import ModelConfig, RMSNorm, apply_rope, axial_rope_cos_sin, even_shard_bounds, grid_positions

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
            raise self.error("rope_axes_dim", f"every axis needs a positive even channel count, got {list(self.rope_axes_dim)}")
        if sum(self.rope_axes_dim) != self.head_dim:
            raise self.error("rope_axes_dim", f"sum {sum(self.rope_axes_dim)} must equal the head dim {self.head_dim}")


# ---------------------------------------------------------------------------- layouts
def hunyuan_rope(config: HunyuanVideoBlockConfig, grid_thw: tuple[int, int, int], rank: int = 0, world: int = 1,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Rope:
    """cos/sin ``[T*H*W / world, head_dim/2]`` for rank ``rank``'s image shard, at its global (t, h, w)."""
    pos = grid_positions(grid_thw, device=device)
    start, end = even_shard_bounds(pos.shape[0], rank, world)
    return axial_rope_cos_sin(pos[start:end], config.rope_axes_dim, config.rope_theta, dtype)


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
    attn: USPAttention, img_qkv: Sequence[Tensor], txt_qkv: Sequence[Tensor], txt_is_sharded: bool,
    txt_valid_lens: Sequence[int] | None,
) -> Tensor:
    """Attention over [image | text] in the text layout of the module docstring; one ``[B, S, H, D]`` tensor."""
    img_len, txt_len = img_qkv[0].shape[1], txt_qkv[0].shape[1]
    q, k, v = (torch.cat([i, t], dim=1) for i, t in zip(img_qkv, txt_qkv))
    if not txt_is_sharded:
        if txt_valid_lens is not None:
            raise ValueError("txt_valid_lens is only meaningful with txt_is_sharded=True")
        return attn(q, k, v, num_replicated_suffix=txt_len)
    if txt_valid_lens is None:
        raise ValueError("txt_is_sharded=True needs txt_valid_lens (valid text tokens on every rank; see shard_text)")
    if any(n < 0 or n > txt_len for n in txt_valid_lens):
        raise ValueError(f"txt_valid_lens {list(txt_valid_lens)} must each be in [0, {txt_len}] (the local padded text length)")
    return attn(q, k, v, seq_lens=[img_len + int(n) for n in txt_valid_lens])


# ---------------------------------------------------------------------------- pieces
def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class ModulateProjection(nn.Module):
    """``linear(silu(vec))`` split into ``factor`` chunks of ``hidden_size`` (shift/scale/gate ...)."""

    def __init__(self, hidden_size: int, factor: int) -> None:
        super().__init__()
        self.factor = factor
        self.linear = nn.Linear(hidden_size, factor * hidden_size)

    def forward(self, vec: Tensor) -> tuple[Tensor, ...]:
        return self.linear(nn.functional.silu(vec)).chunk(self.factor, dim=-1)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, mlp_hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, mlp_hidden_dim)
        self.fc2 = nn.Linear(mlp_hidden_dim, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x), approximate="tanh"))


class _Stream(nn.Module):
    """One modality's weights in the double-stream block: modulation, QKV, q/k norms, proj, MLP."""

    def __init__(self, config: HunyuanVideoBlockConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.mod = ModulateProjection(h, 6)
        self.norm = nn.LayerNorm(h, elementwise_affine=False, eps=config.norm_eps)
        self.attn_qkv = nn.Linear(h, 3 * h)
        self.attn_q_norm = RMSNorm(config.head_dim, eps=config.qk_norm_eps)
        self.attn_k_norm = RMSNorm(config.head_dim, eps=config.qk_norm_eps)
        self.attn_proj = nn.Linear(h, h)
        self.mlp = MLP(h, config.mlp_hidden_dim)
        self.num_heads = config.num_heads

    def qkv(self, x: Tensor, shift: Tensor, scale: Tensor, rope: Rope | None) -> tuple[Tensor, Tensor, Tensor]:
        b, s, _ = x.shape
        q, k, v = self.attn_qkv(_modulate(self.norm(x), shift, scale)).view(b, s, 3, self.num_heads, -1).unbind(2)
        q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def finish(self, x: Tensor, attn: Tensor, mods: Sequence[Tensor]) -> Tensor:
        _, _, attn_gate, mlp_shift, mlp_scale, mlp_gate = mods
        x = x + attn_gate.unsqueeze(1) * self.attn_proj(attn.flatten(2))
        return x + mlp_gate.unsqueeze(1) * self.mlp(_modulate(self.norm(x), mlp_shift, mlp_scale))


# ---------------------------------------------------------------------------- blocks
class MMDoubleStreamBlock(nn.Module):
    """Separate weights for image and text, one joint attention over [image | text].

    ``forward(img [B, S_img_local, hidden], txt [B, S_txt_local, hidden], vec [B, hidden],
    rope (image tables [S_img_local, head_dim/2]), *, txt_is_sharded=False, txt_valid_lens=None)``
    returns ``(img, txt)`` of the input shapes. Weight names: ``img.*`` / ``txt.*``.
    """

    def __init__(self, config: HunyuanVideoBlockConfig) -> None:
        super().__init__()
        self.img = _Stream(config)
        self.txt = _Stream(config)
        self.attn = USPAttention(config.num_heads, config.head_dim)

    def forward(self, img: Tensor, txt: Tensor, vec: Tensor, rope: Rope, *, txt_is_sharded: bool = False,
                txt_valid_lens: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
        img_mods, txt_mods = self.img.mod(vec), self.txt.mod(vec)
        img_qkv = self.img.qkv(img, img_mods[0], img_mods[1], rope)
        txt_qkv = self.txt.qkv(txt, txt_mods[0], txt_mods[1], None)
        attn = _joint_attention(self.attn, img_qkv, txt_qkv, txt_is_sharded, txt_valid_lens)
        img_attn, txt_attn = attn.split([img.shape[1], txt.shape[1]], dim=1)
        return self.img.finish(img, img_attn, img_mods), self.txt.finish(txt, txt_attn, txt_mods)


class MMSingleStreamBlock(nn.Module):
    """Shared weights over the concatenated [image | text]; attention and MLP run in parallel.

    ``forward(x [B, S_img_local + txt_len, hidden], vec [B, hidden], txt_len, rope (image
    tables [S_img_local, head_dim/2]), *, txt_is_sharded=False, txt_valid_lens=None)`` returns
    ``x``'s shape. ``txt_len`` is the local text length (padded, when sharded).
    """

    def __init__(self, config: HunyuanVideoBlockConfig) -> None:
        super().__init__()
        h, m = config.hidden_size, config.mlp_hidden_dim
        self.hidden_size, self.mlp_hidden_dim, self.num_heads = h, m, config.num_heads
        self.modulation = ModulateProjection(h, 3)
        self.norm = nn.LayerNorm(h, elementwise_affine=False, eps=config.norm_eps)
        self.linear1 = nn.Linear(h, 3 * h + m)
        self.linear2 = nn.Linear(h + m, h)
        self.q_norm = RMSNorm(config.head_dim, eps=config.qk_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, eps=config.qk_norm_eps)
        self.attn = USPAttention(config.num_heads, config.head_dim)

    def forward(self, x: Tensor, vec: Tensor, txt_len: int, rope: Rope, *, txt_is_sharded: bool = False,
                txt_valid_lens: Sequence[int] | None = None) -> Tensor:
        b, s, _ = x.shape
        if not 0 < txt_len < s:
            raise ValueError(f"txt_len={txt_len} must be in (0, {s}) for a joint sequence of {s} tokens")
        shift, scale, gate = self.modulation(vec)
        qkv, mlp = self.linear1(_modulate(self.norm(x), shift, scale)).split([3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)
        q, k, v = qkv.view(b, s, 3, self.num_heads, -1).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)
        img_len = s - txt_len
        img_q, img_k = apply_rope(q[:, :img_len], *rope), apply_rope(k[:, :img_len], *rope)
        attn = _joint_attention(
            self.attn, (img_q, img_k, v[:, :img_len]), (q[:, img_len:], k[:, img_len:], v[:, img_len:]),
            txt_is_sharded, txt_valid_lens,
        )
        # The joint output is already in [image | text] order, which is linear2's input order.
        out = self.linear2(torch.cat([attn.flatten(2), nn.functional.gelu(mlp, approximate="tanh")], dim=-1))
        return x + gate.unsqueeze(1) * out
