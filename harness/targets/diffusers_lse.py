"""A CPU attention kernel that returns the log-sum-exp, for diffusers' ring templates (``--target-arg lse_kernel``).

diffusers 0.42.1 has no CPU backend whose ring op returns the LSE (``native`` raises), so its ring
and unified templates could not run, and go ungated, on the CPU. This is torch's own CPU flash
kernel (what ``native`` picks there) through the aten ops that expose the LSE and its backward,
``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``, wrapped in diffusers'
forward_op / backward_op signature and handed to diffusers' own
``_templated_context_parallel_attention``: what runs is diffusers' ring code, forward and backward,
with this op per block. A ``[B, S_k]`` key mask becomes ``[B, 1, 1, S_k]`` as in
``_native_attention``; a row with no kept key gets the LSE ``-inf``, as an exact kernel gives it.
"""

from __future__ import annotations

from typing import Any

import torch

KERNEL = "aten._scaled_dot_product_flash_attention_for_cpu"
#: ``--target-arg lse_kernel=NAME``: the kernel of each ring block where the backend's own op returns no LSE.
LSE_KERNELS = ("cpu_flash", "none")


def _additive(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean keep-mask as the additive mask of ``dtype`` the CPU op takes."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(~attn_mask, float("-inf"))


def _heads_first(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.transpose(1, 2) for t in tensors]


def _forward_op(
    ctx: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config: Any = None,
) -> Any:
    """diffusers' forward_op: ``[B, S, H, D]`` in, ``out [B, S, H, D]`` and ``lse [B, S, H]`` (model layout) out."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_heads_first(query, key, value), dropout_p, is_causal, attn_mask=_additive(attn_mask, query.dtype), scale=scale
    )
    if attn_mask is not None:  # the op gives lse 0 to a row with no kept key; its true LSE is -inf
        lse = lse.masked_fill(~attn_mask.any(dim=-1).expand(lse.shape), float("-inf"))
    out, lse = out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()
    if _save_ctx:
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.attn_mask, ctx.is_causal, ctx.scale = attn_mask, is_causal, scale
    return (out, lse) if return_lse else out


def _backward_op(
    ctx: Any,
    grad_out: torch.Tensor,
    *args: Any,
    query: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' backward_op: the saved block, or the ring's block with the merged ``out`` and ``lse`` it passes."""
    saved = ctx.saved_tensors
    query, key, value, out, lse = (
        given if given is not None else s for given, s in zip((query, key, value, out, lse), saved)
    )
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_heads_first(grad_out, query, key, value, out),
        lse.transpose(1, 2).contiguous(),
        0.0,
        ctx.is_causal,
        attn_mask=_additive(ctx.attn_mask, query.dtype),
        scale=ctx.scale,
    )
    return tuple(g.transpose(1, 2) for g in grads)  # type: ignore[return-value]


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    parallel_config: Any,
) -> torch.Tensor:
    """diffusers' context-parallel templates with this kernel for every block (a ring config: degree > 1)."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    if attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
        attn_mask = attn_mask[:, None, None, :]  # as _native_attention reshapes it
    return _templated_context_parallel_attention(
        query,
        key,
        value,
        attn_mask,
        0.0,
        is_causal,
        scale,
        enable_gqa,
        False,
        forward_op=_forward_op,
        backward_op=_backward_op,
        _parallel_config=parallel_config,
    )
