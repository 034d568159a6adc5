"""The default target: ``reference_impl``'s USPAttention, the implementation the contracts describe."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from harness.targets.base import AttentionSpec, Target, Unsupported
from reference_impl.attention.backends import AttentionBackend, PinnedKernelRefused, backend_class
from reference_impl.attention.layer import USPAttention
from reference_impl.attention.selector import attention_backend_config, attention_component
from reference_impl.forward_context import set_forward_context
from reference_impl.parallel.state import destroy_sequence_parallel, init_sequence_parallel


class ReferenceAttention:
    """USPAttention called inside a forward context (the contracts know nothing of that context)."""

    def __init__(self, layer: USPAttention, sdpa_kernel: str | None) -> None:
        self.layer = layer
        self.sdpa_kernel = sdpa_kernel
        self.backend = layer.backend.value
        pinned = f"[{sdpa_kernel}]" if sdpa_kernel else ""
        self.kernel = f"{self.backend}{pinned} ({layer.selection.level})"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        try:
            with set_forward_context():
                return self.layer(q, k, v, **kwargs)
        except PinnedKernelRefused as exc:  # identically on every rank, before anything is computed
            raise Unsupported(str(exc)) from exc


class ReferenceTarget(Target):
    name = "reference"

    def capabilities(self) -> frozenset[str]:
        return frozenset(
            {
                "ulysses", "ring", "gqa", "causal", "replicated_prefix", "replicated_suffix",
                "replicated_kv_prefix", "varlen", "mask", "backend_choice", "backend_selection", "reference_models",
            }
        )

    def init_parallel(self, ulysses_degree: int, ring_degree: int) -> None:
        init_sequence_parallel(ulysses_degree, ring_degree)

    def destroy_parallel(self) -> None:
        destroy_sequence_parallel()

    def make_attention(self, spec: AttentionSpec) -> ReferenceAttention:
        if spec.backend is not None:
            # An unknown name raises ValueError listing the valid ones; a backend that cannot serve
            # this case here (missing package, head size, dtype) skips it.
            reason = _cannot_serve(backend_class(spec.backend), spec)
            if reason:
                raise Unsupported(f"backend {spec.backend} cannot run this case here: {reason}")
        with attention_backend_config(spec.backend_config):
            with attention_component(spec.component) if spec.component else nullcontext():
                layer = USPAttention(
                    spec.num_heads,
                    spec.head_dim,
                    num_kv_heads=spec.num_kv_heads,
                    causal=spec.causal,
                    softmax_scale=spec.softmax_scale,
                    supported_attention_backends=spec.supported_backends,
                    default_attention_backend=spec.default_backend,
                    skip_sequence_parallel=spec.skip_sequence_parallel,
                    backend=spec.backend,
                    sdpa_kernel=spec.sdpa_kernel,
                    dtype=spec.dtype,
                )
        return ReferenceAttention(layer, spec.sdpa_kernel)


def _cannot_serve(cls: type[AttentionBackend], spec: AttentionSpec) -> str | None:
    reason = cls.unavailable_reason()
    if reason is None and not cls.supports_head_size(spec.head_dim):
        reason = f"head size {spec.head_dim} is not supported"
    if reason is None and not cls.supports_dtype(spec.dtype):
        reason = f"it does not compute in {spec.dtype}"
    return reason


def factory() -> ReferenceTarget:
    return ReferenceTarget()
