"""Adapter for yunchang 0.6.4 (``UlyssesAttention`` and ``LongContextAttention``).

yunchang has no replicated tokens, varlen entry, mask, GQA or backend selector on these layers, so
it declares none and those contracts skip with the reason. Its torch kernels call CUDA-only aten
ops and its all-to-alls move CUDA tensors, so it runs only on CUDA with one GPU per rank (NCCL).
The kernel is flash-attn when installed, else torch's flash kernel for fp16/bf16 and the efficient
kernel for fp32 (UlyssesAttention's torch path always runs flash, so it takes no fp32). The
single-rank reference calls the same kernel through yunchang's own wrapper.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harness.targets.base import AttentionSpec, Target, Unsupported

NOT_INSTALLED = "yunchang is not installed (pip install yunchang==0.6.4)"
CUDA_ONLY = "yunchang's torch kernels call CUDA-only aten ops; it runs only on CUDA with one GPU per rank"

_LAYERS = ("long_context", "ulysses")


class YunchangAttention:
    def __init__(self, fn: Callable[..., Any], backend: str, kernel: str, spec: AttentionSpec) -> None:
        self._fn = fn
        self._spec = spec
        self.backend = backend
        self.kernel = kernel

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if kwargs:
            raise Unsupported(f"yunchang takes no {', '.join(sorted(kwargs))}")
        out = self._fn(q, k, v, softmax_scale=self._spec.softmax_scale, causal=self._spec.causal)
        return out[0] if isinstance(out, tuple) else out


class YunchangTarget(Target):
    """``layer="long_context"`` (Ulysses × ring) or ``layer="ulysses"`` (Ulysses only)."""

    def __init__(self, layer: str = "long_context") -> None:
        if layer not in _LAYERS:
            raise ValueError(f"unknown yunchang layer {layer!r}; valid: {', '.join(_LAYERS)}")
        self.layer = layer
        self.name = "yunchang" if layer == "long_context" else "yunchang-ulysses"

    def capabilities(self) -> frozenset[str]:
        return frozenset({"ulysses", "causal", "ring"} if self.layer == "long_context" else {"ulysses", "causal"})

    def version(self) -> str | None:
        import importlib.metadata

        try:
            return importlib.metadata.version("yunchang")
        except importlib.metadata.PackageNotFoundError:
            return None

    def unavailable_reason(self, device: str) -> str | None:
        if importlib.util.find_spec("yunchang") is None:
            return NOT_INSTALLED
        if torch.device(device).type != "cuda":
            return CUDA_ONLY
        return None

    def init_parallel(self, ulysses_degree: int, ring_degree: int) -> None:
        if dist.get_backend() != "nccl":
            raise Unsupported(f"{CUDA_ONLY} (this group is {dist.get_backend()}: more ranks than GPUs)")
        from yunchang import set_seq_parallel_pg

        set_seq_parallel_pg(ulysses_degree, ring_degree, dist.get_rank(), dist.get_world_size())

    def destroy_parallel(self) -> None:
        if importlib.util.find_spec("yunchang") is None:
            return
        from yunchang.globals import PROCESS_GROUP

        PROCESS_GROUP.ULYSSES_PG = None
        PROCESS_GROUP.RING_PG = None

    def make_attention(self, spec: AttentionSpec) -> YunchangAttention:
        from yunchang import LongContextAttention, UlyssesAttention
        from yunchang.globals import HAS_FLASH_ATTN, PROCESS_GROUP
        from yunchang.kernels import AttnType, select_flash_attn_impl

        if spec.num_kv_heads not in (None, spec.num_heads):
            raise Unsupported("yunchang needs as many K/V heads as query heads")
        if spec.dtype not in (torch.float16, torch.bfloat16) and (HAS_FLASH_ATTN or self.layer == "ulysses"):
            # Seen on an H200: UlyssesAttention's torch path (ring_pytorch_attn_func) runs torch's
            # flash kernel whatever attn_type says, and flash-attn itself is fp16/bf16 only.
            raise Unsupported(
                f"yunchang {self.layer} with {'flash-attn' if HAS_FLASH_ATTN else 'torch kernels'} runs flash attention: fp16/bf16 only, not {spec.dtype}"
            )
        if HAS_FLASH_ATTN:
            attn_type = AttnType.FA
        else:
            attn_type = AttnType.TORCH_EFFICIENT if spec.dtype == torch.float32 else AttnType.TORCH_FLASH
        kernel = f"yunchang:{attn_type.value}"
        if spec.skip_sequence_parallel:
            local = select_flash_attn_impl(attn_type, stage="fwd-only")
            return YunchangAttention(local, "yunchang-local", kernel, spec)
        if self.layer == "ulysses":
            layer: torch.nn.Module = UlyssesAttention(PROCESS_GROUP.ULYSSES_PG, attn_type=attn_type)
        else:
            layer = LongContextAttention(ring_impl_type="basic", attn_type=attn_type)
        return YunchangAttention(layer, f"yunchang-{self.layer}", kernel, spec)


def factory() -> YunchangTarget:
    return YunchangTarget("long_context")


def ulysses_factory() -> YunchangTarget:
    return YunchangTarget("ulysses")
