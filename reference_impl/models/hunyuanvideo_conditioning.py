"""HunyuanVideo's conditioning: timestep + guidance + pooled-text embedding, and the text token refiner.

As diffusers 0.42.1 computes them (``HunyuanVideoConditionEmbedding``,
``HunyuanVideoTokenRefiner``), under diffusers' parameter names. The token refiner runs over
the text alone with a ``[B, 1, L, L]`` mask (valid query × valid key, key 0 always open so a
padding row is never empty); under sequence parallelism every rank holds the whole text, so
it runs rank-locally (``skip_sequence_parallel``) and is the one-rank computation on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reference_impl.models.hunyuanvideo import FeedForward, HunyuanAttention
from reference_impl.models.layers import timestep_embedding

Tensor = torch.Tensor

TIME_PROJ_DIM = 256
REFINER_MLP_RATIO = 4.0  # diffusers builds the refiner with its default ratio, not the config's mlp_ratio
NORM_EPS = 1e-6


class _TwoLayer(nn.Module):
    """``linear_2(silu(linear_1(x)))``: diffusers' ``TimestepEmbedding`` and ``PixArtAlphaTextProjection(act_fn="silu")``."""

    def __init__(self, in_features: int, hidden_size: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class ConditionEmbedding(nn.Module):
    """``embed(t) [+ embed(guidance)] + project(pooled text)``; t and guidance through the sinusoidal embedding.

    With ``guidance=False`` this is also diffusers' ``CombinedTimestepTextProjEmbeddings`` (the refiner's).
    """

    def __init__(self, hidden_size: int, pooled_dim: int, guidance: bool) -> None:
        super().__init__()
        self.timestep_embedder = _TwoLayer(TIME_PROJ_DIM, hidden_size)
        self.text_embedder = _TwoLayer(pooled_dim, hidden_size)
        self.guidance_embedder = _TwoLayer(TIME_PROJ_DIM, hidden_size) if guidance else None

    def forward(self, timestep: Tensor, pooled: Tensor, guidance: Tensor | None = None) -> Tensor:
        if (guidance is None) != (self.guidance_embedder is None):
            raise ValueError(
                "a guidance-distilled model needs a guidance tensor; a model without guidance_embeds takes none"
            )
        t_emb = self.timestep_embedder(timestep_embedding(timestep, TIME_PROJ_DIM).to(pooled.dtype))
        text = self.text_embedder(pooled)
        if self.guidance_embedder is None or guidance is None:
            return t_emb + text
        return t_emb + self.guidance_embedder(timestep_embedding(guidance, TIME_PROJ_DIM).to(pooled.dtype)) + text


class _Gates(nn.Module):
    """diffusers' ``HunyuanVideoAdaNorm``: ``linear(silu(temb))`` → the attention and MLP gates ``[B, 1, hidden]``."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 2 * hidden_size)

    def forward(self, temb: Tensor) -> tuple[Tensor, Tensor]:
        gate_msa, gate_mlp = self.linear(F.silu(temb)).chunk(2, dim=1)
        return gate_msa.unsqueeze(1), gate_mlp.unsqueeze(1)


class TokenRefinerBlock(nn.Module):
    """Pre-norm self-attention and SiLU MLP over the text, each gated by the refiner's conditioning."""

    def __init__(self, hidden_size: int, num_heads: int, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, eps=NORM_EPS)
        self.attn = HunyuanAttention(
            hidden_size, num_heads, qk_norm_eps=None, project_out=True, local=True, compute_dtype=compute_dtype
        )
        self.norm2 = nn.LayerNorm(hidden_size, eps=NORM_EPS)
        self.ff = FeedForward(hidden_size, int(hidden_size * REFINER_MLP_RATIO), activation="silu")
        self.norm_out = _Gates(hidden_size)

    def forward(self, x: Tensor, temb: Tensor, attn_mask: Tensor) -> Tensor:
        q, k, v = self.attn.qkv(self.norm1(x))
        assert self.attn.to_out is not None
        attn = self.attn.to_out[0](self.attn.attn(q, k, v, attn_mask=attn_mask).flatten(2))
        gate_msa, gate_mlp = self.norm_out(temb)
        x = x + attn * gate_msa
        return x + self.ff(self.norm2(x)) * gate_mlp


class IndividualTokenRefiner(nn.Module):
    def __init__(
        self, hidden_size: int, num_heads: int, num_layers: int, compute_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.refiner_blocks = nn.ModuleList(
            TokenRefinerBlock(hidden_size, num_heads, compute_dtype) for _ in range(num_layers)
        )

    def forward(self, x: Tensor, temb: Tensor, mask: Tensor) -> Tensor:
        """``mask [B, L]``: valid text tokens. Query i attends key j iff both are valid; key 0 always."""
        pair = mask[:, None, None, :] & mask[:, None, :, None]
        pair[:, :, :, 0] = True
        for block in self.refiner_blocks:
            x = block(x, temb, pair)
        return x


class TokenRefiner(nn.Module):
    """Text features ``[B, L, text_dim]`` → ``[B, L, hidden]``, conditioned on t and the masked mean of the text."""

    def __init__(
        self, text_dim: int, hidden_size: int, num_heads: int, num_layers: int, compute_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.time_text_embed = ConditionEmbedding(hidden_size, text_dim, guidance=False)
        self.proj_in = nn.Linear(text_dim, hidden_size)
        self.token_refiner = IndividualTokenRefiner(hidden_size, num_heads, num_layers, compute_dtype)

    def forward(self, text: Tensor, timestep: Tensor, mask: Tensor) -> Tensor:
        weights = mask.float().unsqueeze(-1)
        pooled = ((text * weights).sum(dim=1) / weights.sum(dim=1)).to(text.dtype)
        return self.token_refiner(self.proj_in(text), self.time_text_embed(timestep, pooled), mask.bool())
