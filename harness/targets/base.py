"""The target interface: the only way the harness reaches an implementation under test.

An attention :class:`Target` builds the attention layer the contracts judge; a
:class:`PipelineTarget` generates the images or frames (and timings) the gate's image and perf
stages judge. A target is resolved inside each rank from its spec string (``--target
module:factory``), so nothing unpicklable crosses a process boundary. Every target must honour
``AttentionSpec.skip_sequence_parallel=True`` as rank-local attention with the kernel it uses under
SP (the contracts' single-rank reference); everything else is a declared :class:`Capability`, and a
contract needing one a target lacks is skipped with the reason, never failed. The guide: docs/targets/attention.md.
"""

from __future__ import annotations

import importlib.metadata
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


class Capability(StrEnum):
    """What a target can declare; a contract requires a subset. Each is the keyword argument or mode a contract
    uses, so a target that lacks one is never handed it. A StrEnum: overlays, external targets and docs keep the
    bare names (``"ulysses"`` equals ``Capability.ULYSSES``)."""

    ULYSSES = "ulysses"
    RING = "ring"
    GQA = "gqa"
    CAUSAL = "causal"
    REPLICATED_PREFIX = "replicated_prefix"
    REPLICATED_SUFFIX = "replicated_suffix"
    REPLICATED_KV_PREFIX = "replicated_kv_prefix"
    VARLEN = "varlen"
    MASK = "mask"
    RING_MASK = "ring_mask"
    RING_REPLICATED = "ring_replicated"
    MASKED_REPLICATED_PREFIX = "masked_replicated_prefix"
    BACKEND_CHOICE = "backend_choice"
    BACKEND_SELECTION = "backend_selection"
    REFERENCE_MODELS = "reference_models"
    BACKWARD = "backward"


CAPABILITIES: dict[Capability, str] = {
    Capability.ULYSSES: "sequence parallelism by all-to-all over heads (ulysses_degree > 1)",
    Capability.RING: "ring attention over K/V blocks (ring_degree > 1)",
    Capability.GQA: "fewer K/V heads than query heads (num_kv_heads < num_heads)",
    Capability.CAUSAL: "causal attention",
    Capability.REPLICATED_PREFIX: "forward(..., num_replicated_prefix=n)",
    Capability.REPLICATED_SUFFIX: "forward(..., num_replicated_suffix=n)",
    Capability.REPLICATED_KV_PREFIX: "forward(..., num_replicated_kv_prefix=n)",
    Capability.VARLEN: "forward(..., seq_lens=[one valid length per rank])",
    Capability.MASK: "forward(..., attn_mask=bool mask [B, S_k] or [B, 1|H, S_q, S_k])",
    Capability.RING_MASK: "attn_mask under ring attention (each rank holds the mask of its own K/V shard)",
    Capability.RING_REPLICATED: "num_replicated_prefix / _suffix / _kv_prefix under ring attention (ring_degree > 1)",
    Capability.MASKED_REPLICATED_PREFIX: "forward(..., attn_mask=[B, n + S_k] key mask, num_replicated_prefix=n) under SP",
    Capability.BACKEND_CHOICE: "AttentionSpec.backend names the kernel family to run",
    Capability.BACKEND_SELECTION: "AttentionSpec.backend_config / default_backend / component / supported_backends",
    Capability.REFERENCE_MODELS: "the target is reference_impl itself: model-level checks (model.*, encoder.*, vae.*) run "
    "its models",
    Capability.BACKWARD: "the attention is differentiable: out.backward(dO) gives q, k and v (the rank's own) their "
    "gradients",
}


#: Capabilities only reference_impl has: a contract requiring one checks reference_impl's own models, so
#: every other target skips it by definition (a skip no overlay needs to pin).
REFERENCE_ONLY = frozenset({Capability.REFERENCE_MODELS})


def distribution_version(name: str) -> str | None:
    """The installed version of the Python distribution ``name`` (its metadata: nothing is imported), None when absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


class Refusal(StrEnum):
    """Why a target refuses a case. Contracts branch on the kind, never on a message text or on an
    implementation's exception class, so any stack's refusal can become a skip or a checked refusal."""

    UNSUPPORTED = "unsupported"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    RING_NEEDS_LSE = "ring_needs_lse"
    MASK_WITH_REPLICATED = "mask_with_replicated"
    NO_BACKWARD = "no_backward"
    LACKS = "lacks"  # the case needs capabilities the target does not declare (the runner's precheck, or the target)
    UNAVAILABLE = "unavailable"  # the target cannot run on this machine at all (the runner's precheck)


REFUSALS: dict[Refusal, str] = {
    Refusal.UNSUPPORTED: "the target cannot express this case (a feature, shape or dtype it lacks)",
    Refusal.BACKEND_UNAVAILABLE: "the requested backend or pinned kernel is missing or cannot serve this case here",
    Refusal.RING_NEEDS_LSE: "ring attention needs a backend that returns the log-sum-exp; this one does not",
    Refusal.MASK_WITH_REPLICATED: "an attention mask together with replicated tokens under sequence parallelism",
    Refusal.NO_BACKWARD: "the target cannot differentiate this case (e.g. a ring merge through a log-sum-exp without a "
    "gradient)",
    Refusal.LACKS: "the case needs a capability the target does not declare",
    Refusal.UNAVAILABLE: "the target cannot run on this machine (not installed, another device)",
}


@dataclass(frozen=True)
class Refused:
    """Why a case did not run, typed: what a pinned skip is matched on (the message's words only narrow it).
    ``lacks``: with :attr:`Refusal.LACKS`, the capabilities the case needs that the target does not declare."""

    kind: Refusal
    lacks: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": str(self.kind), "lacks": sorted(self.lacks)}


class Unsupported(Exception):
    """The target cannot express this case; ``kind`` (a :class:`Refusal`) says which way.

    Raised by a target (mapping its own stack's refusal to a kind, with the stack's message as
    the reason) or by a contract inside a rank, identically on every rank and before any
    collective. The runner reports the case as *skipped* with the reason, unless the contract
    asked for exactly that refusal (then it is the behaviour under test).
    """

    def __init__(
        self, reason: str, kind: Refusal | str = Refusal.UNSUPPORTED, lacks: frozenset[str] = frozenset()
    ) -> None:
        if kind not in REFUSALS:
            raise ValueError(f"unknown refusal kind {kind!r}; valid: {', '.join(REFUSALS)}")
        super().__init__(reason)
        self.reason = reason
        self.kind = Refusal(kind)
        self.lacks = frozenset(lacks)  # with Refusal.LACKS: the capabilities it lacks

    @property
    def refused(self) -> Refused:
        return Refused(self.kind, self.lacks)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason, self.kind, self.lacks))


@dataclass(frozen=True)
class AttentionSpec:
    """What to build. Fields beyond the shape are honoured only by targets declaring the capability."""

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    causal: bool = False
    softmax_scale: float | None = None
    dtype: torch.dtype = torch.float32
    skip_sequence_parallel: bool = False
    backend: str | None = None  # "backend_choice": explicit kernel family; None = the target's default
    sdpa_kernel: str | None = None  # pin torch SDPA to math / flash / efficient / cudnn
    # "backend_selection": the reference selector's inputs, so its precedence can be checked.
    backend_config: str | None = None
    default_backend: str | None = None
    supported_backends: tuple[str, ...] | None = None
    component: str | None = None

    def with_(self, **changes: Any) -> AttentionSpec:
        return replace(self, **changes)


@runtime_checkable
class Attention(Protocol):
    """``attention(q, k, v, **kwargs) -> out`` on ``[B, S_local, H, D]``.

    ``backend`` names the kernel family that was selected and ``kernel`` what actually runs
    (reports print it: bitwise parity is a property of the kernel and the shape).
    """

    backend: str
    kernel: str

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor: ...


class Target(ABC):
    """An implementation under test. Subclass it and return an instance from your factory."""

    name: str = "target"
    #: Whose case overlay (``cases/contracts/targets/<overlay>.toml``) holds this target's version
    #: facts and known divergences; None: its own ``name``. A variant of a stack (a patched layer,
    #: a test backend) names its stack's.
    overlay: str | None = None

    @abstractmethod
    def capabilities(self) -> frozenset[str]:
        """The subset of :class:`Capability` this target supports (the enum or its bare names)."""

    def unavailable_reason(self, device: str) -> str | None:
        """None when the target can run on ``device`` ("cpu", "cuda"), else a sentence saying why not."""
        return None

    def lacks_because(self) -> dict[str, str]:
        """Why the stack lacks a capability it does not declare (the upstream fact), where the adapter knows:
        a skip or "not applicable" quotes it beside the capability's meaning."""
        return {}

    def version(self) -> str | None:
        """The installed version of the implementation (results and the cross-stack matrix name it)."""
        return None

    @abstractmethod
    def init_parallel(self, ulysses_degree: int, ring_degree: int) -> None:
        """Set up sequence parallelism on the live default process group (every rank calls it)."""

    @abstractmethod
    def destroy_parallel(self) -> None:
        """Forget the sequence-parallel state (called after every case, also after a failure)."""

    @abstractmethod
    def make_attention(self, spec: AttentionSpec) -> Attention:
        """Build the attention under test; raise :class:`Unsupported` for what it cannot express."""

    def preload_modules(self) -> tuple[str, ...]:
        """Modules to import once per run, in the preloaded process ranks are forked from, instead of
        once per rank. Default: the module defining this class. Name a stack imported lazily
        (e.g. ``("sglang.multimodal_gen.runtime.layers.attention",)``); never one that initialises
        CUDA at import (a CUDA rank forked from it refuses to start)."""
        return (type(self).__module__,)

    def backend_columns(self, device: str) -> list[str]:
        """Backend names ``parity sweep`` runs as columns on ``device`` (``name`` or ``name:kernel``).
        Default: none besides the target's own choice (``AttentionSpec.backend=None``)."""
        return []

    def check_case(self, contract_id: str, params: Mapping[str, Any]) -> None:
        """Refuse parameters this target can never run, before any rank starts (raise
        ``harness.contracts.params.ParamError`` naming the key: the run exits 2). Default: the
        case's backend and SDPA kernel by :meth:`check_backend`."""
        self.check_backend(params.get("backend"), params.get("sdpa_kernel"))

    def check_backend(self, backend: str | None, sdpa_kernel: str | None) -> None:
        """Refuse a backend name (or a pinned SDPA kernel with it) this target does not have, with a
        ``ParamError`` keyed ``backend`` or ``sdpa_kernel`` that lists the valid names; for case
        parameters and for ``--backend``/``--backends`` alike. Default: accept any name."""

    def model_check(self, name: str) -> Callable[..., Any]:
        """For targets declaring ``reference_models``: the measuring function behind ``model.*``,
        ``encoder.*``, ``vae.*`` and ``pipeline.*`` contracts, called in the rank with keyword
        arguments; it returns typed figures (:mod:`harness.targets.figures`), never a verdict. The
        contracts name the check, never the module."""
        raise Unsupported(f"target {self.name} runs no reference model checks ({name})")


# ------------------------------------------------------------------------------- pipelines


@dataclass(frozen=True)
class Timings:
    """One pipeline run's clock, in sglang's stage names (``TextEncodingStage``, ``DenoisingStage``, ...)."""

    e2e_ms: float
    stages_ms: dict[str, float]
    denoise_step_ms: list[float] = field(default_factory=list)
    clock: str = "perf_counter"


@dataclass
class PipelineOutput:
    """What one run generated: uint8 ``[H, W, 3]`` (image) or ``[T, H, W, 3]`` (video), and how long it took.

    ``nonfinite``: NaN/Inf values the run produced before its uint8 conversion (latents, decoded
    pixels). uint8 cannot hold NaN (it becomes 0), so a NaN run looks like a black image and would
    match a black reference; a target that can count them must, and a non-zero count fails the run.
    """

    output: np.ndarray
    timings: Timings
    backends: dict[str, str] = field(default_factory=dict)
    nonfinite: int = 0


class PreparedPipeline(Protocol):
    """A pipeline set up in a rank (models built, sequence parallelism over the group): run it N times."""

    def run(self) -> PipelineOutput: ...

    def close(self) -> None: ...


class PipelineFailed(Exception):
    """A pipeline run failed in a way its target can explain (an external command's exit status, its stderr).

    The gate fails that case with ``reason`` and keeps ``detail`` (the stderr tail) as the result's
    traceback, then goes on with the next case, as it does for a rank that raised.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason, self.detail))


class PipelineTarget(ABC):
    """A pipeline under test, driven with the *fields* of an image case (prompt, seed, size, steps...).

    Every rank of the case's group calls :meth:`prepare` and then ``run()``; rank 0's output is
    judged. The reference of an N-rank case is the same fields on one rank.

    A target whose ``runs_in_ranks`` is False starts its own processes (an external command that
    does its own parallelism): the gate then starts no rank group for it and calls :meth:`prepare`
    in its own process with the case's ``world_size``, for the target to pass on.
    """

    name: str = "pipeline"
    runs_in_ranks: bool = True
    #: True when every run starts a process of its own (the command target): each run is then its own launch, so
    #: an A/B of it needs no launch blocks to spread process-level bias (pyperf's worker processes, per run).
    process_per_run: bool = False

    def unavailable_reason(self, device: str, world_size: int = 1) -> str | None:
        """None when the pipeline can run on ``device`` at ``world_size``, else a sentence saying why not
        (the case is then skipped with it: a property of this machine, not of the case)."""
        return None

    @abstractmethod
    def check_case(self, fields: Mapping[str, Any], world_size: int) -> str:
        """Validate an image case's fields (``ParamError`` naming the key) and return its kind: "image" or "video"."""

    def identity(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """What a reference made from ``fields`` is pinned to (its fingerprint): the fields, with any that names a
        place on this machine (a model directory) replaced by the content found there, so moving it changes nothing."""
        return dict(fields)

    def output_shape(self, fields: Mapping[str, Any]) -> tuple[int, ...] | None:
        """The uint8 shape a run of checked ``fields`` makes (``(H, W, 3)`` or ``(T, H, W, 3)``), or None when the
        target cannot say before running: ``parity bless --from-results`` refuses a saved candidate of another shape."""
        return None

    def stop(self) -> None:
        """End what this target keeps running between cases (a server it launched); the next :meth:`prepare` starts
        afresh. An A/B calls it between launch blocks, the gate at its end."""

    @abstractmethod
    def prepare(self, fields: Mapping[str, Any], device: str, world_size: int | None = None) -> PreparedPipeline:
        """Build what a run needs. In a rank (``world_size`` None): sequence parallelism over the whole
        default group. With ``runs_in_ranks`` False: in the gate's process, ``world_size`` given."""
