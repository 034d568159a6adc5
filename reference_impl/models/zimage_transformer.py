"""Z-Image DiT as diffusers 0.42.1's ``ZImageTransformer2DModel`` computes it (text to image), sequence-parallel ready.

As diffusers does: caption and image tokens each padded to a multiple of 32 with learned pad tokens, attended to
like any other; the image at positions after the *padded* caption; the modulated ``noise_refiner`` over the image
alone, the unmodulated ``context_refiner`` over the caption alone, then the main layers over ``[image | caption]``;
a batch padded to its longest item, with a key mask over that padding only.

Under sequence parallelism (Ulysses degree W, ring 1) every rank embeds everything and returns the whole output;
the blocks run on shards in layouts that restore single-rank key order, so bitwise (docs/models.md, "Under
sequence parallelism"). Padded lengths are multiples of 32, so any W dividing 32 shards them; another is refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from reference_impl.models.layers import RMSNorm, build_and_load, grid_positions, load_safetensors_into
from reference_impl.models.sequences import TokenStream, gather_shards, ulysses_rank_and_world
from reference_impl.models.zimage import FinalLayer, TimestepEmbedder, ZImageConfig, ZImageTransformerBlock, zimage_rope

Tensor = torch.Tensor

SEQ_MULTIPLE = 32


def padded_length(n: int) -> int:
    """``n`` rounded up to a multiple of 32, as diffusers pads caption and image tokens."""
    return n + (-n) % SEQ_MULTIPLE


def caption_positions(padded_len: int, device: torch.device | str | None = None) -> Tensor:
    """``[padded_len, 3]``: caption token ``i`` (pad tokens included) at ``(1 + i, 0, 0)``."""
    return grid_positions((padded_len, 1, 1), (1, 0, 0), device)


def image_positions(
    grid: tuple[int, int, int], caption_padded_len: int, device: torch.device | str | None = None
) -> Tensor:
    """``[padded(F·H·W), 3]``: token ``(f, h, w)`` at ``(L + 1 + f, h, w)``, then pad tokens at ``(0, 0, 0)``."""
    pos = grid_positions(grid, (caption_padded_len + 1, 0, 0), device)
    n = pos.shape[0]
    return torch.cat([pos, pos.new_zeros(padded_length(n) - n, 3)])


def _embed_padded(embed: nn.Module, items: Sequence[Tensor], pad_token: Tensor) -> list[Tensor]:
    """Each item padded to a multiple of 32 rows, embedded in one call, its padding rows then the pad token.

    As diffusers does it: the padding repeats an item's last row before the embedding, so the
    embedding's GEMM has diffusers' row count (fp32 GEMMs of one row take another kernel).
    """
    lengths = [t.shape[0] for t in items]
    padded = [torch.cat([t, t[-1:].expand(padded_length(n) - n, -1)]) for t, n in zip(items, lengths)]
    embedded = embed(torch.cat(padded)).split([t.shape[0] for t in padded])
    return [torch.cat([e[:n], pad_token.expand(e.shape[0] - n, -1)]) for e, n in zip(embedded, lengths)]


class ZImageTransformer(nn.Module):
    """patchify → embed and pad → noise / context refiners → main layers → final layer → unpatchify.

    ``forward(x, t, cap_feats)`` takes diffusers' inputs: a list of latents ``[C, F, H, W]``
    (one per item; sizes may differ), timesteps ``[B]`` and a list of caption features
    ``[L_i, cap_feat_dim]``; it returns the list of predictions ``[C, F, H, W]``. Parameter
    names are diffusers', so :meth:`from_diffusers` loads a diffusers state dict as it is.
    """

    def __init__(self, config: ZImageConfig, compute_dtype: torch.dtype | None = None) -> None:
        """``compute_dtype``: the dtype the model will run in, which picks each attention layer's backend
        (FlashAttention needs fp16/bf16). The weights are made in the default dtype; cast the model after."""
        super().__init__()
        self.config = c = config
        keys = [f"{p}-{f}" for p, f in zip(c.all_patch_size, c.all_f_patch_size)]
        sizes = [f * p * p * c.in_channels for p, f in zip(c.all_patch_size, c.all_f_patch_size)]
        self.all_x_embedder = nn.ModuleDict({k: nn.Linear(n, c.dim) for k, n in zip(keys, sizes)})
        self.all_final_layer = nn.ModuleDict({k: FinalLayer(c, n) for k, n in zip(keys, sizes)})
        self.noise_refiner = nn.ModuleList(
            ZImageTransformerBlock(c, compute_dtype=compute_dtype) for _ in range(c.n_refiner_layers)
        )
        self.context_refiner = nn.ModuleList(
            ZImageTransformerBlock(c, modulation=False, local=True, compute_dtype=compute_dtype)
            for _ in range(c.n_refiner_layers)
        )
        self.t_embedder = TimestepEmbedder(c)
        self.cap_embedder = nn.Sequential(RMSNorm(c.cap_feat_dim, eps=c.norm_eps), nn.Linear(c.cap_feat_dim, c.dim))
        self.x_pad_token = nn.Parameter(torch.zeros(1, c.dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, c.dim))
        self.layers = nn.ModuleList(ZImageTransformerBlock(c, compute_dtype=compute_dtype) for _ in range(c.n_layers))

    @classmethod
    def from_diffusers(
        cls,
        config: Mapping[str, Any],
        state_dict: Mapping[str, Tensor] | str | os.PathLike[str],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> ZImageTransformer:
        """Build from a diffusers ``config.json`` dict and load a diffusers state dict (or .safetensors file).

        Strict: a missing, unexpected or misshapen tensor is an error naming it, before any is copied.
        """
        return build_and_load(
            lambda: cls(ZImageConfig.from_diffusers(config), compute_dtype=dtype), state_dict, dtype, device
        )

    def load_weights(self, source: Mapping[str, Tensor] | str | os.PathLike[str]) -> list[str]:
        """Load a .safetensors file (or dict) with diffusers' parameter names (= this module's)."""
        return load_safetensors_into(self, source)

    # ------------------------------------------------------------------ tokens
    def _patchify(self, image: Tensor, p: int, pf: int) -> tuple[Tensor, tuple[int, int, int]]:
        c, f, h, w = image.shape
        grid = (f // pf, h // p, w // p)
        x = image.view(c, grid[0], pf, grid[1], p, grid[2], p).permute(1, 3, 5, 2, 4, 6, 0)  # f h w pf ph pw c
        return x.reshape(grid[0] * grid[1] * grid[2], pf * p * p * c), grid

    def _unpatchify(self, tokens: Tensor, size: tuple[int, int, int], p: int, pf: int) -> Tensor:
        f, h, w = size
        c = self.config.in_channels
        x = tokens.view(f // pf, h // p, w // p, pf, p, p, c).permute(6, 0, 3, 1, 4, 2, 5)  # c f pf h ph w pw
        return x.reshape(c, f, h, w)

    def _streams(
        self, x: Sequence[Tensor], cap_feats: Sequence[Tensor], p: int, pf: int
    ) -> tuple[TokenStream, TokenStream]:
        """Embedded, 32-padded image and caption streams with their RoPE tables (whole batch, every rank)."""
        dtype, rope_dtype = self.x_pad_token.dtype, torch.promote_types(self.x_pad_token.dtype, torch.float32)
        patches = [self._patchify(xi.to(dtype), p, pf) for xi in x]
        img = _embed_padded(self.all_x_embedder[f"{p}-{pf}"], [t for t, _ in patches], self.x_pad_token)
        cap = _embed_padded(self.cap_embedder, [c.to(dtype) for c in cap_feats], self.cap_pad_token)
        img_ropes = [
            zimage_rope(self.config, image_positions(grid, c.shape[0], c.device), rope_dtype)
            for (_, grid), c in zip(patches, cap)
        ]
        cap_ropes = [zimage_rope(self.config, caption_positions(c.shape[0], c.device), rope_dtype) for c in cap]
        return TokenStream.pad(img, img_ropes), TokenStream.pad(cap, cap_ropes)

    def _check_inputs(self, x: Sequence[Tensor], cap_feats: Sequence[Tensor], p: int, pf: int) -> None:
        c = self.config
        if not x or len(x) != len(cap_feats):
            raise ValueError(f"need one caption per latent, got {len(x)} latents and {len(cap_feats)} captions")
        for i, (xi, ci) in enumerate(zip(x, cap_feats)):
            if xi.dim() != 4 or xi.shape[0] != c.in_channels or xi.shape[1] % pf or xi.shape[2] % p or xi.shape[3] % p:
                raise ValueError(
                    f"latent {i} {tuple(xi.shape)} must be [{c.in_channels}, F, H, W] with F divisible by "
                    f"{pf} and H, W by {p}"
                )
            if ci.dim() != 2 or ci.shape[0] == 0 or ci.shape[1] != c.cap_feat_dim:
                raise ValueError(f"caption {i} {tuple(ci.shape)} must be [L >= 1, {c.cap_feat_dim}]")

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: Sequence[Tensor],
        t: Tensor | float,
        cap_feats: Sequence[Tensor],
        patch_size: int | None = None,
        f_patch_size: int | None = None,
    ) -> list[Tensor]:
        """Predictions ``[C, F, H, W]`` per item, in each latent's dtype (computed in the weights' dtype)."""
        c = self.config
        p = c.all_patch_size[0] if patch_size is None else patch_size
        pf = c.all_f_patch_size[0] if f_patch_size is None else f_patch_size
        if f"{p}-{pf}" not in self.all_x_embedder:
            raise ValueError(f"patch size {p}-{pf} is not one of this model's: {', '.join(self.all_x_embedder)}")
        self._check_inputs(x, cap_feats, p, pf)
        rank, world = ulysses_rank_and_world(type(self).__name__)
        t = torch.as_tensor(t, dtype=torch.float32, device=x[0].device).reshape(-1).expand(len(x))
        adaln = self.t_embedder(t * c.t_scale).to(self.x_pad_token.dtype)
        img, cap = self._streams(x, cap_feats, p, pf)

        img_local = img.shard(rank, world)
        for layer in self.noise_refiner:
            img_local = img_local.replace(layer(img_local.tokens, img_local.rope, adaln, attn_mask=img_local.mask))
        for layer in self.context_refiner:
            cap = cap.replace(layer(cap.tokens, cap.rope, attn_mask=cap.mask))

        final = self.all_final_layer[f"{p}-{pf}"]
        if img.mask is None and cap.mask is None:
            out = gather_shards(final(self._main_suffix(img_local, cap, adaln), adaln), world)
        else:
            unified = self._unified(img.replace(gather_shards(img_local.tokens, world)), cap)
            out = gather_shards(final(self._main_joint(unified.shard(rank, world), adaln), adaln), world)
        sizes = [tuple(xi.shape[1:]) for xi in x]
        return [
            self._unpatchify(out[i, : n // (p * p * pf)], sizes[i], p, pf).to(x[i].dtype)
            for i, n in enumerate(s[0] * s[1] * s[2] for s in sizes)
        ]

    def _main_suffix(self, img_local: TokenStream, cap: TokenStream, adaln: Tensor) -> Tensor:
        """Items of one length: this rank's image shard, then the whole caption as the replicated suffix."""
        hidden = torch.cat([img_local.tokens, cap.tokens], dim=1)
        rope = (torch.cat([img_local.rope[0], cap.rope[0]], dim=1), torch.cat([img_local.rope[1], cap.rope[1]], dim=1))
        for layer in self.layers:
            hidden = layer(hidden, rope, adaln, num_replicated_suffix=cap.tokens.shape[1])
        return hidden[:, : img_local.tokens.shape[1]]

    @staticmethod
    def _unified(img: TokenStream, cap: TokenStream) -> TokenStream:
        """Per item ``[image | caption]`` (each at its padded length), the batch padded to its longest item."""
        items, ropes = [], []
        for i, (n_img, n_cap) in enumerate(zip(img.lengths, cap.lengths)):
            items.append(torch.cat([img.tokens[i, :n_img], cap.tokens[i, :n_cap]]))
            ropes.append(tuple(torch.cat([a[i, :n_img], b[i, :n_cap]]) for a, b in zip(img.rope, cap.rope)))
        return TokenStream.pad(items, ropes)

    def _main_joint(self, local: TokenStream, adaln: Tensor) -> Tensor:
        """Per-item lengths: a contiguous shard of the unified sequence, its keys masked (see the module docstring)."""
        hidden = local.tokens
        for layer in self.layers:
            hidden = layer(hidden, local.rope, adaln, attn_mask=local.mask)
        return hidden
