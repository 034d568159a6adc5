"""Adapter for xDiT (xfuser 0.7.0): its USP, called as its attention processors call it after their projections.

``xFuserFluxAttnProcessor`` calls ``USP(query, key, value, combine_qkv_a2a=True, attn_layer=attn)`` on ``[B, H, S,
D]`` (transformer_flux.py:249); so does this adapter, with torch's flash kernel (fp16/bf16) or efficient one (fp32,
both ring-capable) passed as ``backend``. USP's all-to-all (torch's functional one) runs for ranks sharing a GPU
over gloo; its ring (torch's ``_templated_ring_attention``) crashed them after its all-gather rotation (SIGSEGV,
seen on an H200), so over gloo a ring degree above 1 is refused with that reason. Parallel state: xfuser's own
(``init_distributed_environment``, ``initialize_model_parallel`` with ``backend="gloo"``) on parity's live group,
and an ``ExternalRuntimeState`` built from ``xFuserArgs`` of the case's degrees (its constructor takes defaults).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import torch
import torch.distributed as dist

from harness.targets.base import AttentionSpec, Target, Unsupported, distribution_version

NOT_INSTALLED = (
    "xfuser is not installed (pip install --no-deps xfuser==0.7.0 distvae==0.1.0, with diffusers and yunchang)"
)
NEEDS_ACCELERATOR = (
    "xfuser 0.7.0 imports only with an accelerator: xfuser/envs.py:138 raises 'No Accelerators ... available' "
    "on a machine without one, and its kernels are CUDA-only aten ops"
)
LACKS = {
    "backward": "xDiT is an inference engine: USP's exchange is torch's functional all_to_all_single "
    "(xfuser/model_executor/layers/usp.py:119), which autograd does not differentiate, and no processor "
    "calls it under autograd",
    "gqa": "USP takes GQA only as kv_head_repeat, which its Flux and HunyuanVideo processors never pass (1)",
}
RING_OVER_GLOO = (
    "xfuser's ring (torch's _templated_ring_attention, all-gather rotation) crashes ranks sharing one GPU over gloo: "
    "SIGSEGV in the kernel or the merge after the first rotation (seen on an H200, torch 2.11); it needs NCCL, "
    "one GPU per rank"
)
SCALE_REFUSED = (
    "xfuser's USP takes no softmax scale: its SDPA kernels run at the default 1/sqrt(head_dim) "
    "(xfuser/core/distributed/attention_backend.py, _sdpa_flash_attn_call / _sdpa_efficient_attn_call)"
)


class XditAttention:
    """USP (or, for the rank-local reference, the same registered kernel) on ``[B, S, H, D]``."""

    def __init__(self, spec: AttentionSpec, backend: Any, local: bool) -> None:
        self._spec, self._backend, self._local = spec, backend, local
        self.backend = "xdit-local" if local else "xdit-usp"
        self.kernel = f"xfuser:{backend.name}"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        from xfuser.model_executor.layers.usp import USP, _get_attention_function

        if kwargs:
            raise Unsupported(f"xfuser's USP takes no {', '.join(sorted(kwargs))}")
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        causal = self._spec.causal
        if self._local:
            out, _ = _get_attention_function(self._backend)(q, k, v, dropout_p=0.0, is_causal=causal)
        else:
            out = USP(q, k, v, is_causal=causal, combine_qkv_a2a=True, backend=self._backend)
        return out.transpose(1, 2)


class XditTarget(Target):
    name = "xdit"
    _ring_over_gloo = False

    def capabilities(self) -> frozenset[str]:
        return frozenset({"ulysses", "ring", "causal"})

    def lacks_because(self) -> dict[str, str]:
        return LACKS

    def version(self) -> str | None:
        return distribution_version("xfuser")

    def unavailable_reason(self, device: str) -> str | None:
        if importlib.util.find_spec("xfuser") is None:
            return NOT_INSTALLED
        if torch.device(device).type != "cuda":
            return NEEDS_ACCELERATOR
        return None

    def preload_modules(self) -> tuple[str, ...]:
        return ()  # xfuser probes the accelerator at import: each CUDA rank imports it itself

    def init_parallel(self, ulysses_degree: int, ring_degree: int) -> None:
        from xfuser.config import xFuserArgs
        from xfuser.core.distributed import init_distributed_environment, initialize_model_parallel, runtime_state

        world = dist.get_world_size()
        local_rank = torch.cuda.current_device()
        init_distributed_environment(world_size=world, rank=dist.get_rank(), local_rank=local_rank, backend="gloo")
        initialize_model_parallel(
            sequence_parallel_degree=world, ulysses_degree=ulysses_degree, ring_degree=ring_degree, backend="gloo"
        )
        config, _ = xFuserArgs(
            model="none", ulysses_degree=ulysses_degree, ring_degree=ring_degree, attention_backend="SDPA_EFFICIENT"
        ).create_config()
        state = runtime_state.ExternalRuntimeState.__new__(runtime_state.ExternalRuntimeState)
        runtime_state.RuntimeState.__init__(state, config)  # ExternalRuntimeState() would take default degrees
        runtime_state._RUNTIME = state
        self._ring_over_gloo = ring_degree > 1 and dist.get_backend() == "gloo"

    def destroy_parallel(self) -> None:
        if "xfuser.core.distributed" not in sys.modules:  # never set up in this rank
            return
        from xfuser.core.distributed import parallel_state, runtime_state
        from yunchang.globals import PROCESS_GROUP

        parallel_state.destroy_model_parallel()
        if parallel_state._WORLD is not None:  # xfuser's world coordinator; parity's default group stays
            parallel_state._WORLD.destroy()
            parallel_state._WORLD = None
        runtime_state._RUNTIME = None
        PROCESS_GROUP.ULYSSES_PG = PROCESS_GROUP.RING_PG = None  # initialize_model_parallel set yunchang's

    def make_attention(self, spec: AttentionSpec) -> XditAttention:
        if spec.num_kv_heads not in (None, spec.num_heads):
            raise Unsupported(LACKS["gqa"])
        if spec.softmax_scale is not None and abs(spec.softmax_scale - spec.head_dim**-0.5) > 1e-12:
            raise Unsupported(SCALE_REFUSED)
        if self._ring_over_gloo and not spec.skip_sequence_parallel:
            raise Unsupported(RING_OVER_GLOO)
        from xfuser.core.distributed.attention_backend import AttentionBackendType

        half = spec.dtype in (torch.float16, torch.bfloat16)
        backend = AttentionBackendType.SDPA_FLASH if half else AttentionBackendType.SDPA_EFFICIENT
        return XditAttention(spec, backend, spec.skip_sequence_parallel)


def factory() -> XditTarget:
    return XditTarget()
