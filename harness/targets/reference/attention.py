"""The default target: ``reference_impl``'s USPAttention, the implementation the contracts describe.

Its own refusals are typed exceptions of ``reference_impl``; this module is where they become the
target-neutral :class:`~harness.targets.base.Unsupported` kinds the contracts understand.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from harness.errors import ParamError
from harness.targets.base import AttentionSpec, Capability, Refusal, Target, Unsupported
from reference_impl.attention.backends import (
    BACKENDS,
    SDPA_KERNELS,
    AttentionBackendEnum,
    KernelRefused,
    backend_class,
)
from reference_impl.attention.layer import (
    MaskWithReplicatedError,
    RingAdmissionError,
    RingBackwardError,
    RingUnsupportedError,
    USPAttention,
)
from reference_impl.attention.selector import BackendRefused, attention_backend_config, attention_component
from reference_impl.forward_context import set_forward_context
from reference_impl.parallel.state import destroy_sequence_parallel, init_sequence_parallel

#: The contracts that run the reference pipeline: their parameters are the pipeline's to check.
PIPELINE_CONTRACTS = frozenset({"pipeline.turbo_drift", "perf.sp_step_ratio"})


@functools.cache
def model_checks() -> dict[str, Callable[..., Any]]:
    """Check name -> the function measuring it (:mod:`harness.targets.figures`). Imported on first use, so a
    rank of another commit (:mod:`.revision`) loads only the modules it runs."""
    from harness.targets.reference import encoder, hunyuan_parity, models, pipeline, vae

    return {
        "model.zimage_sp_parity": models.zimage_sp_parity_worker,
        "model.hunyuan_sp_parity": hunyuan_parity.hunyuan_sp_parity_worker,
        "encoder.masked_causal_lengths": encoder.check_masked_causal_lengths,
        "encoder.quantized_admission": encoder.check_quantized_admission,
        "encoder.packed_qkv_scale": encoder.check_packed_qkv_scale,
        "encoder.fp8_parity": encoder.check_fp8_parity,
        "vae.audio_default": vae.audio_default,
        "vae.audio_fa": vae.audio_fa,
        "vae.audio_cast_restore": vae.audio_cast_restore,
        "vae.video_dispatch": vae.video_dispatch,
        "pipeline.turbo_drift": pipeline.turbo_drift,
        "perf.sp_step_ratio": pipeline.sp_step_ratio,
    }


@contextmanager
def refusals_as_unsupported(forced_backend_refused: bool = False) -> Iterator[None]:
    """The reference's typed refusals as target-neutral kinds (raised identically on every rank, before any collective).

    ``forced_backend_refused``: a strictly chosen backend that cannot serve a layer (BackendRefused)
    is a refusal too. Not for a layer built from an AttentionSpec: there it is the selector's
    behaviour that ``backend.selection_precedence`` checks (a ValueError, not a silent fallback).
    """
    try:
        yield
    except RingAdmissionError as exc:
        raise Unsupported(str(exc), kind=Refusal.RING_NEEDS_LSE) from exc
    except MaskWithReplicatedError as exc:
        raise Unsupported(str(exc), kind=Refusal.MASK_WITH_REPLICATED) from exc
    except RingBackwardError as exc:
        raise Unsupported(str(exc), kind=Refusal.NO_BACKWARD) from exc
    except RingUnsupportedError as exc:
        raise Unsupported(str(exc)) from exc
    except KernelRefused as exc:
        raise Unsupported(str(exc), kind=Refusal.BACKEND_UNAVAILABLE) from exc
    except BackendRefused as exc:
        if not forced_backend_refused:
            raise
        raise Unsupported(str(exc), kind=Refusal.BACKEND_UNAVAILABLE) from exc


class ReferenceAttention:
    """USPAttention called inside a forward context (the contracts know nothing of that context)."""

    def __init__(self, layer: USPAttention, sdpa_kernel: str | None) -> None:
        self.layer = layer
        self.sdpa_kernel = sdpa_kernel
        self.backend = layer.backend.value
        pinned = f"[{sdpa_kernel}]" if sdpa_kernel else ""
        self.kernel = f"{self.backend}{pinned} ({layer.selection.level})"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        with refusals_as_unsupported(), set_forward_context():
            return self.layer(q, k, v, **kwargs)


class ReferenceTarget(Target):
    name = "reference"

    def version(self) -> str | None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"parity {version('parity')}"
        except PackageNotFoundError:
            return None

    def capabilities(self) -> frozenset[str]:
        c = Capability
        return frozenset(
            {
                c.ULYSSES,
                c.RING,
                c.GQA,
                c.CAUSAL,
                c.REPLICATED_PREFIX,
                c.REPLICATED_SUFFIX,
                c.REPLICATED_KV_PREFIX,
                c.RING_REPLICATED,
                c.VARLEN,
                c.MASK,
                c.BACKEND_CHOICE,
                c.BACKEND_SELECTION,
                c.REFERENCE_MODELS,
                c.BACKWARD,
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
            refuse_unservable(spec.backend, spec.dtype, spec.head_dim)
        with refusals_as_unsupported(), attention_backend_config(spec.backend_config):
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

    def backend_columns(self, device: str) -> list[str]:
        """Every backend; on CUDA also every pinned SDPA kernel (the kernel decides bitwise parity)."""
        columns = [e.value for e in BACKENDS]
        if device == "cuda":
            columns += [f"torch_sdpa:{k}" for k in SDPA_KERNELS]
        return columns

    def check_backend(self, backend: str | None, sdpa_kernel: str | None) -> None:
        chosen = None
        if backend is not None:
            try:
                chosen = AttentionBackendEnum.parse(backend)
            except ValueError as exc:
                raise ParamError("backend", str(exc)) from None
        if sdpa_kernel is not None and sdpa_kernel not in SDPA_KERNELS:
            raise ParamError("sdpa_kernel", f"unknown SDPA kernel {sdpa_kernel!r}; valid: {', '.join(SDPA_KERNELS)}")
        if sdpa_kernel is not None and chosen not in (None, AttentionBackendEnum.TORCH_SDPA):
            raise ParamError("sdpa_kernel", f"a pinned SDPA kernel applies to torch_sdpa only, not to {chosen.value}")

    def check_case(self, contract_id: str, params: Mapping[str, Any]) -> None:
        super().check_case(contract_id, params)
        if contract_id in PIPELINE_CONTRACTS:
            from harness.targets.reference.pipeline import check_pipeline_case

            check_pipeline_case(params)

    def model_check(self, name: str) -> Callable[..., Any]:
        checks = model_checks()
        if name not in checks:
            raise Unsupported(f"the reference target has no model check {name!r}; it has: {', '.join(checks)}")
        check = checks[name]

        def run(**kwargs: Any) -> Any:
            if kwargs.get("backend") and "dtype_name" in kwargs:  # a model in fp32 cannot run a fp16/bf16 kernel
                from harness.targets.reference.models import torch_dtype

                refuse_unservable(kwargs["backend"], torch_dtype(kwargs["dtype_name"]))
            with refusals_as_unsupported(forced_backend_refused=True):
                return check(**kwargs)

        return run


def refuse_unservable(backend: str, dtype: torch.dtype, head_dim: int | None = None) -> None:
    """Skip a case whose named backend cannot serve it here: package missing, head size, or dtype (fp32 on a
    fp16/bf16 kernel); ``head_dim`` None: not known before the model is built."""
    cls = backend_class(backend)
    reason = cls.unavailable_reason()
    if reason is None and head_dim is not None and not cls.supports_head_size(head_dim):
        reason = f"head size {head_dim} is not supported"
    if reason is None and not cls.supports_dtype(dtype):
        reason = f"it does not compute in {dtype}"
    if reason:
        raise Unsupported(f"backend {backend} cannot run this case here: {reason}", kind=Refusal.BACKEND_UNAVAILABLE)


def factory() -> ReferenceTarget:
    return ReferenceTarget()


def backend_report() -> list[dict[str, Any]]:
    """Every reference backend: available here or why not, whether it returns the LSE, its dtypes (``parity doctor``)."""
    return [
        {
            "name": enum.value,
            "available": cls.unavailable_reason() is None,
            "reason": cls.unavailable_reason(),
            "returns_lse": cls.supports_ring_rotation(),
            "implementation": cls.implementation(),
            "dtypes": sorted(str(d).replace("torch.", "") for d in cls.supported_dtypes),
        }
        for enum, cls in BACKENDS.items()
    ]
