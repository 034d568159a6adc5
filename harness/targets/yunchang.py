"""Adapter for yunchang 0.6.4 (``UlyssesAttention`` and ``LongContextAttention``), through its own code.

yunchang has no replicated tokens, varlen entry, mask or backend selector on these layers, so it declares
none and those contracts skip with the reason. Its torch kernels call CUDA-only aten ops, so it runs on
CUDA only. Ranks sharing one GPU talk over gloo: yunchang's all-to-alls run there as they are, its ring's
point-to-point transfers go through host memory (:mod:`harness.targets.yunchang_transport`; gloo cannot
send CUDA tensors point to point). fp16/bf16 run flash-attn when its 2.x API is installed, else torch's
flash kernel; fp32 runs the efficient kernel either way (UlyssesAttention's torch path always runs flash,
so it takes no fp32). The single-rank reference calls the same kernel through yunchang's wrapper.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harness.targets.base import AttentionSpec, Target, Unsupported, distribution_version
from harness.targets.yunchang_transport import direct_ring_transfers, stage_ring_transfers

NOT_INSTALLED = "yunchang is not installed (pip install yunchang==0.6.4)"
CUDA_ONLY = "yunchang's torch kernels call CUDA-only aten ops (_scaled_dot_product_flash/efficient_attention); it runs only on CUDA"
# What yunchang 0.6.4 cannot do, in its own code (yunchang/kernels/attention.py).
LACKS = {
    "backward": "yunchang 0.6.4 differentiates only through flash-attn's 2.x API: with torch kernels its "
    "pytorch_attn_backward raises 'Not implemented backward for PyTorch attention types' (kernels/attention.py:159)",
    "gqa": "yunchang 0.6.4's kernels call aten._scaled_dot_product_flash_attention / _efficient_attention "
    "directly, with as many K/V heads as query heads (kernels/attention.py:68, :77)",
}

_LAYERS = ("long_context", "ulysses")


def has_flash_attn_2() -> bool:
    """yunchang's own test (globals.py): flash_attn with the 2.x ``flash_attn_interface`` entry points."""
    from yunchang.globals import HAS_FLASH_ATTN

    return bool(HAS_FLASH_ATTN)


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
        found = {"ulysses", "causal", "ring"} if self.layer == "long_context" else {"ulysses", "causal"}
        installed = importlib.util.find_spec("yunchang") is not None
        return frozenset(found | ({"backward"} if installed and has_flash_attn_2() else set()))

    def lacks_because(self) -> dict[str, str]:
        return {cap: why for cap, why in LACKS.items() if cap not in self.capabilities()}

    def version(self) -> str | None:
        return distribution_version("yunchang")

    def unavailable_reason(self, device: str) -> str | None:
        if importlib.util.find_spec("yunchang") is None:
            return NOT_INSTALLED
        if torch.device(device).type != "cuda":
            return CUDA_ONLY
        return None

    def init_parallel(self, ulysses_degree: int, ring_degree: int) -> None:
        from yunchang import set_seq_parallel_pg

        if dist.get_backend() == "gloo":  # ranks sharing a GPU: the ring's P2P through host memory
            stage_ring_transfers()
        set_seq_parallel_pg(ulysses_degree, ring_degree, dist.get_rank(), dist.get_world_size())

    def destroy_parallel(self) -> None:
        if importlib.util.find_spec("yunchang") is None:
            return
        from yunchang.globals import PROCESS_GROUP

        PROCESS_GROUP.ULYSSES_PG = None
        PROCESS_GROUP.RING_PG = None
        direct_ring_transfers()

    def make_attention(self, spec: AttentionSpec) -> YunchangAttention:
        from yunchang import LongContextAttention, UlyssesAttention
        from yunchang.globals import PROCESS_GROUP
        from yunchang.kernels import AttnType, select_flash_attn_impl

        if spec.num_kv_heads not in (None, spec.num_heads):
            raise Unsupported(LACKS["gqa"])
        half = spec.dtype in (torch.float16, torch.bfloat16)
        if not half and self.layer == "ulysses":
            # Seen on an H200: UlyssesAttention's torch path (ring_pytorch_attn_func) runs torch's
            # flash kernel whatever attn_type says.
            raise Unsupported(f"yunchang ulysses runs flash attention: fp16/bf16 only, not {spec.dtype}")
        if half:
            attn_type = AttnType.FA if has_flash_attn_2() else AttnType.TORCH_FLASH
        else:  # flash-attn is fp16/bf16 only: fp32 takes yunchang's efficient kernel, installed or not
            attn_type = AttnType.TORCH_EFFICIENT
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
