"""HunyuanVideo DiT as diffusers 0.42.1's ``HunyuanVideoTransformer3DModel`` computes it (text to video).

Conv3d patch embedding → token refiner on the text → timestep + guidance + pooled-text conditioning → double- then
single-stream blocks over ``[image | text]`` with the text key mask in every block → continuous AdaLN norm →
projection → unpatchify. Like diffusers, the mask keeps each item's first ``sum(encoder_attention_mask[i])`` tokens.

Under sequence parallelism (Ulysses degree W, ring 1) every rank embeds and refines everything, the blocks run on
shards and every rank returns the whole prediction. ``text_layout="replicated"`` (default) is bitwise, padded or
not; ``"sharded"`` follows the FlashAttention rule and needs one valid text length for every item. The layouts and
what each needs: docs/models.md, "Under sequence parallelism".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from reference_impl.models.hunyuanvideo import (
    HunyuanVideoBlockConfig,
    MMDoubleStreamBlock,
    MMSingleStreamBlock,
    hunyuan_rope,
    shard_text,
)
from reference_impl.models.hunyuanvideo_conditioning import ConditionEmbedding, TokenRefiner
from reference_impl.models.layers import ModelConfig, build_and_load, even_shard_bounds, load_safetensors_into
from reference_impl.models.sequences import gather_shards, key_mask, ulysses_rank_and_world

Tensor = torch.Tensor
Rope = tuple[Tensor, Tensor]

TEXT_LAYOUTS = ("replicated", "sharded")
FINAL_NORM_EPS = 1e-6


@dataclass(frozen=True)
class HunyuanVideoConfig(ModelConfig):
    """``HunyuanVideoTransformer3DModel``'s config keys; defaults are the released model's.

    ``image_condition_type="latent_concat"`` only widens ``in_channels`` and is accepted;
    ``"token_replace"`` (other blocks) is not implemented.
    """

    in_channels: int = 16
    out_channels: int | None = 16
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    num_layers: int = 20
    num_single_layers: int = 40
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 2
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"
    guidance_embeds: bool = True
    text_embed_dim: int = 4096
    pooled_projection_dim: int = 768
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, ...] = (16, 56, 56)
    image_condition_type: str | None = None

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def out(self) -> int:
        return self.out_channels or self.in_channels

    @property
    def blocks(self) -> HunyuanVideoBlockConfig:
        return HunyuanVideoBlockConfig(
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            mlp_ratio=self.mlp_ratio,
            rope_axes_dim=self.rope_axes_dim,
            rope_theta=self.rope_theta,
        )

    def validate(self) -> None:
        for key in (
            "in_channels",
            "num_attention_heads",
            "attention_head_dim",
            "patch_size",
            "patch_size_t",
            "text_embed_dim",
            "pooled_projection_dim",
        ):
            if getattr(self, key) <= 0:
                raise self.error(key, f"must be positive, got {getattr(self, key)}")
        for key in ("num_layers", "num_single_layers", "num_refiner_layers"):
            if getattr(self, key) < 0:
                raise self.error(key, f"must be >= 0, got {getattr(self, key)}")
        if self.qk_norm != "rms_norm":
            raise self.error("qk_norm", f"only 'rms_norm' is implemented, got {self.qk_norm!r}")
        if self.image_condition_type not in (None, "latent_concat"):
            raise self.error(
                "image_condition_type", f"{self.image_condition_type!r} is not implemented (None or 'latent_concat')"
            )
        if self.mlp_ratio <= 0:
            raise self.error("mlp_ratio", f"must be positive, got {self.mlp_ratio}")
        if len(self.rope_axes_dim) != 3 or any(d <= 0 or d % 2 for d in self.rope_axes_dim):
            raise self.error(
                "rope_axes_dim", f"needs 3 positive even channel counts (t, h, w), got {list(self.rope_axes_dim)}"
            )
        if sum(self.rope_axes_dim) != self.attention_head_dim:
            raise self.error(
                "rope_axes_dim",
                f"sum {sum(self.rope_axes_dim)} must equal attention_head_dim={self.attention_head_dim}",
            )


class PatchEmbed(nn.Module):
    """``Conv3d`` with kernel = stride = the patch, then ``[B, C, T, H, W]`` → ``[B, T·H·W, hidden]``."""

    def __init__(self, config: HunyuanVideoConfig) -> None:
        super().__init__()
        patch = (config.patch_size_t, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=patch, stride=patch)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class ContinuousNorm(nn.Module):
    """diffusers' ``AdaLayerNormContinuous`` (affine-free): ``LayerNorm(x)·(1 + scale) + shift``, scale first."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 2 * hidden_size)
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=FINAL_NORM_EPS)

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        scale, shift = self.linear(F.silu(temb).to(x.dtype)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


@dataclass(frozen=True)
class _Local:
    """This rank's share of the blocks' input: tokens, image RoPE rows, block keywords, output tokens kept."""

    img: Tensor
    txt: Tensor
    rope: Rope
    layout: dict[str, Any]
    keep: int


class HunyuanVideoTransformer(nn.Module):
    """``forward(hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, pooled_projections,
    guidance=None, text_layout="replicated")`` with diffusers' inputs and output ``[B, C_out, F, H, W]``."""

    def __init__(self, config: HunyuanVideoConfig, compute_dtype: torch.dtype | None = None) -> None:
        """``compute_dtype``: the dtype the model will run in, which picks each attention layer's backend
        (FlashAttention needs fp16/bf16). The weights are made in the default dtype; cast the model after."""
        super().__init__()
        self.config = c = config
        h = c.hidden_size
        self.x_embedder = PatchEmbed(c)
        self.context_embedder = TokenRefiner(
            c.text_embed_dim, h, c.num_attention_heads, c.num_refiner_layers, compute_dtype
        )
        self.time_text_embed = ConditionEmbedding(h, c.pooled_projection_dim, c.guidance_embeds)
        self.transformer_blocks = nn.ModuleList(
            MMDoubleStreamBlock(c.blocks, compute_dtype) for _ in range(c.num_layers)
        )
        self.single_transformer_blocks = nn.ModuleList(
            MMSingleStreamBlock(c.blocks, compute_dtype) for _ in range(c.num_single_layers)
        )
        self.norm_out = ContinuousNorm(h)
        self.proj_out = nn.Linear(h, c.patch_size_t * c.patch_size * c.patch_size * c.out)

    @classmethod
    def from_diffusers(
        cls,
        config: Mapping[str, Any],
        state_dict: Mapping[str, Tensor] | str | os.PathLike[str],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> HunyuanVideoTransformer:
        """Build from a diffusers ``config.json`` dict and load a diffusers state dict (or .safetensors file), strictly."""
        return build_and_load(
            lambda: cls(HunyuanVideoConfig.from_diffusers(config), compute_dtype=dtype), state_dict, dtype, device
        )

    def load_weights(self, source: Mapping[str, Tensor] | str | os.PathLike[str]) -> list[str]:
        """Load a .safetensors file (or dict) with diffusers' parameter names (= this module's)."""
        return load_safetensors_into(self, source)

    def forward(
        self,
        hidden_states: Tensor,
        timestep: Tensor,
        encoder_hidden_states: Tensor,
        encoder_attention_mask: Tensor,
        pooled_projections: Tensor,
        guidance: Tensor | None = None,
        text_layout: str = "replicated",
    ) -> Tensor:
        c = self.config
        b, _, f, h, w = hidden_states.shape
        self._check_inputs(
            hidden_states, encoder_hidden_states, encoder_attention_mask, pooled_projections, text_layout
        )
        rank, world = ulysses_rank_and_world(type(self).__name__)
        dtype = self.proj_out.weight.dtype
        grid = (f // c.patch_size_t, h // c.patch_size, w // c.patch_size)
        rope = hunyuan_rope(
            c.blocks, grid, device=hidden_states.device, dtype=torch.promote_types(dtype, torch.float32)
        )
        temb = self.time_text_embed(timestep, pooled_projections.to(dtype), guidance)
        img = self.x_embedder(hidden_states.to(dtype))
        txt = self.context_embedder(encoder_hidden_states.to(dtype), timestep, encoder_attention_mask)
        lengths = [int(n) for n in encoder_attention_mask.sum(dim=1, dtype=torch.int)]

        local = self._local(img, txt, lengths, rope, rank, world, text_layout)
        x = self._blocks(local, temb)
        out = gather_shards(self.proj_out(self.norm_out(x[:, : local.keep], temb)), world)[:, : img.shape[1]]
        p, pt = c.patch_size, c.patch_size_t
        out = out.reshape(b, *grid, -1, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return out.flatten(6, 7).flatten(4, 5).flatten(2, 3).to(hidden_states.dtype)

    def _local(
        self, img: Tensor, txt: Tensor, lengths: list[int], rope: Rope, rank: int, world: int, text_layout: str
    ) -> _Local:
        """This rank's tokens in the text layout the module docstring describes."""
        n_img, n_txt = img.shape[1], txt.shape[1]
        if text_layout == "sharded":
            if len(set(lengths)) != 1:
                raise ValueError(
                    f"text_layout='sharded' needs one text length for every item (seq_lens is one length per "
                    f"rank, not per item); got {lengths}: use text_layout='replicated'"
                )
            start, end = even_shard_bounds(n_img, rank, world)
            txt_local, valid = shard_text(txt[:, : lengths[0]], rank, world)
            return _Local(
                img[:, start:end],
                txt_local,
                (rope[0][start:end], rope[1][start:end]),
                {"txt_is_sharded": True, "txt_valid_lens": valid},
                end - start,
            )
        if all(n == n_txt for n in lengths):
            start, end = even_shard_bounds(n_img, rank, world)
            return _Local(img[:, start:end], txt, (rope[0][start:end], rope[1][start:end]), {}, end - start)
        if (n_img + n_txt) % world:
            raise ValueError(
                f"padded text under SP shards the joint sequence: {n_img} image + {n_txt} text tokens do not "
                f"divide by {world} ranks (pad the text, masked, to a length that makes them)"
            )
        start, end = even_shard_bounds(n_img + n_txt, rank, world)
        i0, i1 = min(start, n_img), min(end, n_img)
        mask = key_mask([n_img + n for n in lengths], n_img + n_txt, img.device)
        assert mask is not None
        return _Local(
            img[:, i0:i1],
            txt[:, max(start, n_img) - n_img : max(end, n_img) - n_img],
            (rope[0][i0:i1], rope[1][i0:i1]),
            {"attn_mask": mask[:, start:end]},
            end - start,
        )

    def _blocks(self, local: _Local, temb: Tensor) -> Tensor:
        img, txt = local.img, local.txt
        for block in self.transformer_blocks:
            img, txt = block(img, txt, temb, local.rope, **local.layout)
        x = torch.cat([img, txt], dim=1)
        for block in self.single_transformer_blocks:
            x = block(x, temb, txt.shape[1], local.rope, **local.layout)
        return x

    def _check_inputs(self, hidden: Tensor, text: Tensor, mask: Tensor, pooled: Tensor, text_layout: str) -> None:
        c = self.config
        if (
            hidden.dim() != 5
            or hidden.shape[1] != c.in_channels
            or hidden.shape[2] % c.patch_size_t
            or hidden.shape[3] % c.patch_size
            or hidden.shape[4] % c.patch_size
        ):
            raise ValueError(
                f"hidden_states {tuple(hidden.shape)} must be [B, {c.in_channels}, F, H, W] with F divisible by "
                f"{c.patch_size_t} and H, W by {c.patch_size}"
            )
        b = hidden.shape[0]
        if text.dim() != 3 or text.shape[0] != b or text.shape[2] != c.text_embed_dim:
            raise ValueError(f"encoder_hidden_states must be [{b}, L, {c.text_embed_dim}], got {tuple(text.shape)}")
        if tuple(mask.shape) != tuple(text.shape[:2]):
            raise ValueError(f"encoder_attention_mask must be [{b}, {text.shape[1]}], got {tuple(mask.shape)}")
        if tuple(pooled.shape) != (b, c.pooled_projection_dim):
            raise ValueError(f"pooled_projections must be [{b}, {c.pooled_projection_dim}], got {tuple(pooled.shape)}")
        if text_layout not in TEXT_LAYOUTS:
            raise ValueError(f"text_layout {text_layout!r} is not one of {', '.join(TEXT_LAYOUTS)}")
