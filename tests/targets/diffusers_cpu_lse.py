"""TEST-ONLY: a diffusers backend that returns the LSE on the CPU, so diffusers' ring code can be measured.

diffusers 0.42.1 has no CPU backend that returns the log-sum-exp (``native`` raises), so its ring
and unified templates cannot run here. This module puts torch's CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, which returns ``(out, lse)``) into the
registry slot of ``_native_cudnn``: the CUDA backend through which diffusers users reach ring
attention with a mask and the LSE. The slot is filled only for the duration of each call and
restored after, so other targets in the same rank pool see diffusers unchanged.

What is measured is diffusers' own code: ``_templated_context_parallel_attention`` and the
Ulysses / ring / unified templates it selects, with this op as their ``forward_op``. The op
mirrors ``_native_attention``'s mask handling (a ``[B, S_k]`` mask becomes ``[B, 1, 1, S_k]``)
and returns ``-inf`` as the LSE of a row with no kept key, as an exact LSE kernel does. It has
no backward pass (contracts run forward only). Never import it from ``harness/``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from harness.targets.base import AttentionSpec
from harness.targets.diffusers import DiffusersAttention, DiffusersTarget

SLOT = "_native_cudnn"
KERNEL = "aten._scaled_dot_product_flash_attention_for_cpu"


def _as_4d(attn_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """``[B, S_k]`` -> ``[B, 1, 1, S_k]``, as diffusers' ``_native_attention`` does before dispatching."""
    if attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
        return attn_mask[:, None, None, :]
    return attn_mask


def _flash_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
               is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, S, H, D], lse [B, S, H])`` from ``[B, S, H, D]`` inputs and a boolean keep-mask."""
    additive = None
    if attn_mask is not None:  # the CPU op takes an additive mask of the query's dtype
        additive = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0.0, is_causal, attn_mask=additive, scale=scale
    )
    if attn_mask is not None:  # the op gives lse 0 to a row with no kept key; its true LSE is -inf
        empty = ~attn_mask.any(dim=-1).expand(lse.shape)
        lse = lse.masked_fill(empty, float("-inf"))
    return out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()


def _forward_op(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                return_lse: bool = False, _save_ctx: bool = True, _parallel_config: Any = None) -> Any:
    """diffusers' forward_op signature (see ``_cudnn_attention_forward_op``)."""
    out, lse = _flash_cpu(query, key, value, attn_mask, is_causal, scale)
    return (out, lse) if return_lse else out


def _backward_op(ctx: Any, grad_out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("the test-only CPU LSE backend is forward-only")


def cpu_flash_lse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                            dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                            enable_gqa: bool = False, return_lse: bool = False, _parallel_config: Any = None) -> Any:
    """A backend function in diffusers' shape (see ``_native_cudnn_attention``): local op, or diffusers' CP templates."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    attn_mask = _as_4d(attn_mask, query, key)
    if _parallel_config is None:
        out, lse = _flash_cpu(query, key, value, attn_mask, is_causal, scale)
        return (out, lse) if return_lse else out
    return _templated_context_parallel_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
        forward_op=_forward_op, backward_op=_backward_op, _parallel_config=_parallel_config,
    )


@contextmanager
def in_slot() -> Iterator[None]:
    """diffusers' registry entry for :data:`SLOT` holds :func:`cpu_flash_lse_attention` inside the block."""
    import inspect

    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry as registry

    slot = AttentionBackendName(SLOT)
    saved = registry._backends[slot], registry._supported_arg_names[slot]
    registry._backends[slot] = cpu_flash_lse_attention
    registry._supported_arg_names[slot] = set(inspect.signature(cpu_flash_lse_attention).parameters)
    try:
        yield
    finally:
        registry._backends[slot], registry._supported_arg_names[slot] = saved


class InSlotAttention:
    """Every call of the diffusers attention runs with the slot filled; the kernel says so."""

    def __init__(self, inner: DiffusersAttention) -> None:
        self.inner = inner
        self.backend = inner.backend

    @property
    def kernel(self) -> str:
        return f"{self.inner.kernel} [test-only {KERNEL} in diffusers' {SLOT} slot]"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        with in_slot():
            return self.inner(q, k, v, **kwargs)


class CpuLseTarget(DiffusersTarget):
    """The diffusers target with :data:`SLOT` as its backend, filled by the CPU LSE kernel."""

    name = "diffusers_cpu_lse"

    def __init__(self) -> None:
        super().__init__(backend=SLOT)

    def make_attention(self, spec: AttentionSpec) -> InSlotAttention:  # type: ignore[override]
        with in_slot():
            return InSlotAttention(super().make_attention(spec))


def factory() -> CpuLseTarget:
    return CpuLseTarget()

