"""LocalAttention and USPAttention: the attention layers models call.

USPAttention takes ``[B, S_local, H, D]`` per rank and runs Ulysses (all-to-all heads↔sequence),
ring (:mod:`.ring`) or both; replicated tokens skip the all-to-all. The replicated suffix stays at
the tail, so every query scans K/V in the single-rank order: why the suffix output is bitwise equal
to one rank (sglang seed 001). Every path is differentiable (a replicated token's gradient is whole
and identical on every rank, like its value). Guards refuse combinations that would silently
corrupt output, on every rank before any collective, so a refusal never leaves a peer blocked.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from reference_impl.attention import ring
from reference_impl.attention.backends import AttentionBackend, AttentionBackendEnum, TorchSDPABackend, requires_grad
from reference_impl.attention.selector import BackendSelection, select_attn_backend
from reference_impl.forward_context import get_forward_context
from reference_impl.parallel import comm
from reference_impl.parallel.state import (
    get_ring_world_size,
    get_sp_world_size,
    get_ulysses_group,
    get_ulysses_world_size,
)

Tensor = torch.Tensor


def _instantiate(selection: BackendSelection, sdpa_kernel: str | None) -> AttentionBackend:
    if selection.backend is TorchSDPABackend:
        return TorchSDPABackend(kernel=sdpa_kernel)
    if sdpa_kernel is not None:
        raise ValueError(f"sdpa_kernel={sdpa_kernel!r} only applies to torch_sdpa, not {selection.enum.value}")
    return selection.backend()


def _as_dense_mask(attn_mask: Tensor) -> Tensor:
    """A ``[B, S_k]`` key-padding mask becomes ``[B, 1, 1, S_k]``; 4-D masks pass through."""
    if attn_mask.dim() == 2:
        return attn_mask[:, None, None, :]
    if attn_mask.dim() != 4:
        raise ValueError(f"attn_mask must be [B, S_k] or [B, 1|H, S_q, S_k], got shape {tuple(attn_mask.shape)}")
    return attn_mask


class RingAdmissionError(RuntimeError):
    """Ring degree > 1 with a backend that returns no log-sum-exp (refused at construction)."""


class MaskWithReplicatedError(NotImplementedError):
    """An attention mask with replicated tokens under SP: refused on every rank before any collective.

    The masked path gathers keys over ranks; replicated tokens would be duplicated W times.
    """


class RingUnsupportedError(NotImplementedError):
    """A combination the ring path does not serve (varlen, masks, a causal K/V prefix), refused before any collective."""


class RingBackwardError(RuntimeError):
    """Ring attention asked for a gradient with a backend whose log-sum-exp has none (refused before any collective).

    The ring merges its blocks by their LSE: a merge through an LSE without a gradient would treat
    the merge weights as constants and return wrong gradients without an error.
    """


class _AttentionBase(nn.Module):
    """Backend selection shared by both layers; exposes ``.backend`` (the enum) and ``.selection``."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int | None = None,
        causal: bool = False,
        softmax_scale: float | None = None,
        supported_attention_backends: Iterable[AttentionBackendEnum | str] | None = None,
        default_attention_backend: AttentionBackendEnum | str | None = None,
        is_cross_attention: bool = False,
        *,
        backend: AttentionBackendEnum | str | None = None,
        sdpa_kernel: str | None = None,
        dtype: torch.dtype | None = None,
        component: str | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.causal = causal
        self.softmax_scale = softmax_scale
        requested = dtype if dtype is not None else torch.get_default_dtype()
        self.selection = select_attn_backend(
            head_size,
            requested,
            supported_attention_backends,
            default_attention_backend,
            is_cross_attention,
            backend=backend,
            component=component,
        )
        self.backend: AttentionBackendEnum = self.selection.enum
        self.attn_impl = _instantiate(self.selection, sdpa_kernel)
        # The dtype this backend computes in: callers holding other dtypes cast to it (audio VAE).
        self.dtype: torch.dtype = self.selection.backend.preferred_dtype(requested)

    def _local(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        mask = _as_dense_mask(attn_mask) if attn_mask is not None else None
        out = self.attn_impl.forward(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, attn_mask=mask)
        assert isinstance(out, Tensor)
        return out

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, backend={self.backend.value}"


class LocalAttention(_AttentionBase):
    """Rank-local attention with backend selection (text encoders, tile-local work)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        get_forward_context(type(self).__name__)
        return self._local(q, k, v, attn_mask)


class USPAttention(_AttentionBase):
    """Unified sequence-parallel attention (Ulysses × ring) with replicated tokens, varlen and masks."""

    def __init__(self, *args: Any, skip_sequence_parallel: bool = False, **kwargs: Any) -> None:
        """The parameters of :class:`LocalAttention`, and ``skip_sequence_parallel``: run rank-locally
        (tile-local work inside an SP group), which also skips the ring admission below."""
        super().__init__(*args, **kwargs)
        self.skip_sequence_parallel = skip_sequence_parallel
        num_heads = self.num_heads
        # Tile-local layers hold their whole K/V and never rotate, so they need no ring capability.
        if (
            not skip_sequence_parallel
            and get_ring_world_size() > 1
            and not self.selection.backend.supports_ring_rotation()
        ):
            raise RingAdmissionError(
                f"ring attention (ring degree {get_ring_world_size()}) needs a backend that returns the "
                f"log-sum-exp; {self.backend.value} does not (choose another backend or skip_sequence_parallel=True)"
            )
        if not skip_sequence_parallel:
            self._check_heads(num_heads, self.num_kv_heads)

    @staticmethod
    def _check_heads(num_heads: int, num_kv_heads: int) -> None:
        ulysses = get_ulysses_world_size()
        if num_heads % ulysses or num_kv_heads % ulysses:
            raise ValueError(
                f"{num_heads} query heads and {num_kv_heads} KV heads must both be divisible by "
                f"the Ulysses degree {ulysses}"
            )

    # ------------------------------------------------------------------ entry point
    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None = None,
        num_replicated_prefix: int = 0,
        num_replicated_suffix: int = 0,
        num_replicated_kv_prefix: int = 0,
        seq_lens: Sequence[int] | None = None,
    ) -> Tensor:
        get_forward_context(type(self).__name__)
        replicated = num_replicated_prefix + num_replicated_suffix + num_replicated_kv_prefix
        if min(num_replicated_prefix, num_replicated_suffix, num_replicated_kv_prefix) < 0:
            raise ValueError("replicated token counts must be >= 0")
        if num_replicated_prefix and num_replicated_suffix:
            raise NotImplementedError("a replicated prefix and a replicated suffix in one call are not supported")
        if seq_lens is not None and (attn_mask is not None or replicated):
            raise ValueError("seq_lens (varlen) cannot be combined with attn_mask or replicated tokens")
        parallel = not self.skip_sequence_parallel and get_sp_world_size() > 1
        if not parallel:
            return self._forward_single_rank(q, k, v, attn_mask, seq_lens)
        # Every guard below is a local check that every rank evaluates identically, before any collective.
        if attn_mask is not None and replicated:
            raise MaskWithReplicatedError(
                "the masked sequence-parallel path does not consume replicated tokens: they would be "
                "duplicated on every rank and corrupt the output (num_replicated_prefix/suffix/kv_prefix "
                f"= {num_replicated_prefix}/{num_replicated_suffix}/{num_replicated_kv_prefix})"
            )
        self._check_ring(q, k, v, attn_mask, seq_lens, num_replicated_kv_prefix)
        self._check_heads(q.shape[2], k.shape[2])
        if seq_lens is not None:
            return self._forward_varlen(q, k, v, seq_lens)
        if attn_mask is not None:
            return self._forward_masked(q, k, v, attn_mask)
        if num_replicated_suffix:
            return self._forward_replicated(q, k, v, num_replicated_suffix, at_tail=True)
        if num_replicated_prefix:
            return self._forward_replicated(q, k, v, num_replicated_prefix, at_tail=False)
        if num_replicated_kv_prefix:
            return self._forward_replicated_kv_prefix(q, k, v, num_replicated_kv_prefix)
        return self._forward_sharded(q, k, v)

    def _check_ring(
        self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, seq_lens: Sequence[int] | None, kv_prefix: int
    ) -> None:
        if get_ring_world_size() == 1:
            return
        if seq_lens is not None or attn_mask is not None:
            raise RingUnsupportedError(
                f"{'seq_lens (varlen)' if seq_lens is not None else 'attn_mask'} does not support ring parallelism"
            )
        if kv_prefix and self.causal:
            raise RingUnsupportedError("a causal layer with a replicated K/V prefix does not support ring parallelism")
        if requires_grad(q, k, v) and not self.attn_impl.lse_has_gradient():
            raise RingBackwardError(
                f"{self.backend.value} cannot differentiate ring attention: the log-sum-exp it returns has no "
                "gradient, so the merge of the ring's blocks would be wrong (choose math, or torch_sdpa unpinned)"
            )

    @property
    def _blocks(self) -> ring.Blocks:
        return ring.Blocks(self.attn_impl, self.causal, self.softmax_scale)

    # ------------------------------------------------------------------ paths
    def _forward_single_rank(
        self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, seq_lens: Sequence[int] | None
    ) -> Tensor:
        if seq_lens is None:
            return self._local(q, k, v, attn_mask)
        if len(seq_lens) != 1:
            raise ValueError(f"seq_lens has {len(seq_lens)} entries but this layer runs on 1 rank")
        n = int(seq_lens[0])
        out = self._local(q[:, :n], k[:, :n], v[:, :n])
        return torch.cat([out, out.new_zeros(q.shape[0], q.shape[1] - n, *out.shape[2:])], dim=1)

    def _forward_sharded(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        group = get_ulysses_group()
        q, k, v = comm.seq_to_head_all_to_all((q, k, v), group)
        out = ring.ring_attention(self._blocks, q, k, v) if get_ring_world_size() > 1 else self._local(q, k, v)
        return comm.head_to_seq_all_to_all(out, group)

    def _head_slice(self, t: Tensor) -> Tensor:
        """This Ulysses rank's heads of a replicated tensor (KV heads sliced by their own count)."""
        return comm.split(t, dim=2, group=get_ulysses_group())

    def _forward_replicated(self, q: Tensor, k: Tensor, v: Tensor, num_rep: int, at_tail: bool) -> Tensor:
        """Sharded tokens go through the all-to-all; replicated ones keep their place (head-sliced)."""
        if num_rep > q.shape[1]:
            raise ValueError(f"{num_rep} replicated tokens but only {q.shape[1]} tokens on this rank")
        group = get_ulysses_group()

        def split(t: Tensor) -> tuple[Tensor, Tensor]:
            return (t[:, :-num_rep], t[:, -num_rep:]) if at_tail else (t[:, num_rep:], t[:, :num_rep])

        parts = [split(t) for t in (q, k, v)]
        sharded = tuple(comm.seq_to_head_all_to_all([s for s, _ in parts], group))
        reps = tuple(self._head_slice(r) for _, r in parts)
        if get_ring_world_size() > 1:
            out_shard, out_rep = ring.replicated_tokens(self._blocks, sharded, reps, at_tail)  # type: ignore[arg-type]
        else:
            out = self._local(*(torch.cat([s, r] if at_tail else [r, s], dim=1) for s, r in zip(sharded, reps)))
            n_shard = out.shape[1] - num_rep
            out_shard, out_rep = (
                (out[:, :n_shard], out[:, n_shard:]) if at_tail else (out[:, num_rep:], out[:, :num_rep])
            )
        out_shard = comm.head_to_seq_all_to_all(out_shard, group)
        out_rep = comm.all_gather(out_rep, dim=2, group=group)
        return torch.cat([out_shard, out_rep] if at_tail else [out_rep, out_shard], dim=1)

    def _forward_replicated_kv_prefix(self, q: Tensor, k: Tensor, v: Tensor, num_rep: int) -> Tensor:
        """Cross attention on cached K/V: the first ``num_rep`` K/V tokens are replicated, queries sharded."""
        if num_rep > k.shape[1]:
            raise ValueError(f"{num_rep} replicated K/V tokens but only {k.shape[1]} K/V tokens on this rank")
        group = get_ulysses_group()
        q, k_shard, v_shard = comm.seq_to_head_all_to_all((q, k[:, num_rep:], v[:, num_rep:]), group)
        k_rep, v_rep = (self._head_slice(t[:, :num_rep]) for t in (k, v))
        if get_ring_world_size() > 1:
            out = ring.replicated_kv_prefix(self._blocks, q, (k_shard, v_shard), (k_rep, v_rep))
        else:
            out = self._local(q, torch.cat([k_rep, k_shard], dim=1), torch.cat([v_rep, v_shard], dim=1))
        return comm.head_to_seq_all_to_all(out, group)

    def _forward_varlen(self, q: Tensor, k: Tensor, v: Tensor, seq_lens: Sequence[int]) -> Tensor:
        """Uneven per-rank lengths: rank r holds ``seq_lens[r]`` valid tokens, padded to a common length."""
        world = get_ulysses_world_size()
        lens = [int(n) for n in seq_lens]
        if len(lens) != world or any(n < 0 or n > q.shape[1] for n in lens):
            raise ValueError(f"seq_lens {lens} must give one length per rank (world {world}), each <= {q.shape[1]}")
        group, padded_len = get_ulysses_group(), q.shape[1]
        q, k, v = comm.seq_to_head_all_to_all_varlen((q, k, v), lens, group)
        return comm.head_to_seq_all_to_all_varlen(self._local(q, k, v), lens, padded_len, group)

    def _forward_masked(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor) -> Tensor:
        """Masked Ulysses: a ``[B, S_local]`` key mask is gathered; a full 4-D mask is head-sliced."""
        group = get_ulysses_group()
        if attn_mask.dim() == 2:
            mask = comm.all_gather(attn_mask, dim=1, group=group)
        else:
            mask = _as_dense_mask(attn_mask)
            if mask.shape[1] not in (1, q.shape[2]):
                raise ValueError(f"attn_mask head dim {mask.shape[1]} must be 1 or {q.shape[2]}")
            if mask.shape[1] > 1:
                mask = self._head_slice(mask.transpose(1, 2)).transpose(1, 2)
        q, k, v = comm.seq_to_head_all_to_all((q, k, v), group)
        return comm.head_to_seq_all_to_all(self._local(q, k, v, mask), group)
