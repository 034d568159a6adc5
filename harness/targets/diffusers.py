"""Adapter for diffusers' context parallelism: ``dispatch_attention_fn`` under ``ContextParallelConfig``.

The config is set up as ``ModelMixin._resolve_parallel_config`` does, on the live default group;
``enable_parallelism`` is not used (on the CPU it divides by a device count of 0, and the attention
under test is the dispatch, not a model's hooks). What runs is diffusers' own Ulysses/ring/unified
templates with the backend ``backend=`` names; the adapter only maps the contract's calling
convention (``seq_lens`` becomes unpadded shards under ``ulysses_anything``), so a divergence is
diffusers', never the adapter's. Refusals keep diffusers' words. Ring and hybrid on ``native``,
whose op returns no LSE, run each block through :mod:`.diffusers_lse` (``lse_kernel=cpu_flash``, the
default; ``none``: stock); ``ulysses_anything`` has no backward (``no_backward``). docs/targets/attention.md.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from harness.errors import ConfigError, ParamError
from harness.targets import diffusers_lse
from harness.targets.base import AttentionSpec, Refusal, Target, Unsupported, distribution_version

MIN_VERSION = "0.36"  # ContextParallelConfig and the templated CP attention first ship in 0.36.0
NOT_INSTALLED = "diffusers is not installed (pip install 'parity[diffusers]')"

# Masks are declared on every release (a stack's wrong mask is an expected failure, not a missing
# capability): one rank takes them everywhere, and where a release refuses them under CP its own
# refusal is the skip (CP_MASK_SINCE).
_ALWAYS = frozenset({"ulysses", "ring", "gqa", "causal", "backend_choice", "mask", "ring_mask", "backward"})
# Capabilities that arrived after MIN_VERSION: (capability, first release, the upstream fact),
# read from the 0.36.0-0.42.1 sources of models/attention_dispatch.py and _modeling_parallel.py.
VERSIONED: tuple[tuple[str, str, str], ...] = (
    ("varlen", "0.37", "ContextParallelConfig(ulysses_anything=True): uneven per-rank lengths under Ulysses"),
)
# 0.36's _templated_context_parallel_attention opens with `if attn_mask is not None: raise
# ValueError("Attention mask is not yet supported for templated attention.")`, before any collective;
# PR #12970 (first in 0.37.0) removed the guard. Before this release that ValueError is a refusal.
CP_MASK_SINCE = "0.37"

# Context-parallel backends whose ring forward op cannot return the LSE, and that op's name
# (0.42.1: attention_dispatch.py:876 native, :2082 NPU). The op itself is asked, rank-locally, so
# the refusal carries diffusers' current words, and a release that adds the LSE is admitted.
_RING_FORWARD_OPS = {"native": "_native_attention_forward_op", "_native_npu": "_npu_attention_forward_op"}


@functools.cache
def installed_version() -> str | None:
    """The installed diffusers' version (read once per process: a layer names it on every varlen call)."""
    return distribution_version("diffusers")


def _at_least(version: str, floor: str) -> bool:
    from packaging.version import Version  # a dependency of diffusers itself

    return Version(version) >= Version(floor)


def capabilities_for(version: str) -> frozenset[str]:
    """What this adapter can drive on diffusers ``version`` (see :data:`VERSIONED`)."""
    return _ALWAYS | {cap for cap, since, _ in VERSIONED if _at_least(version, since)}


def backend_names() -> list[str]:
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [member.value for member in AttentionBackendName]


def _check_backend_name(name: str) -> None:
    """A ParamError on ``backend`` listing the valid names unless ``name`` is a diffusers ``AttentionBackendName``."""
    valid = backend_names()
    if name not in valid:
        raise ParamError(
            "backend",
            f"{name!r} is not a diffusers {installed_version()} AttentionBackendName; valid: {', '.join(valid)}",
        )


class DiffusersAttention:
    """One attention layer: diffusers' dispatch with this spec's backend, causality and scale.

    ``lse_kernel``: the ring's blocks run through :mod:`.diffusers_lse` (the backend's own op has no LSE).
    """

    def __init__(self, spec: AttentionSpec, backend: str, parallel: _Parallel | None, lse_kernel: bool = False) -> None:
        self.spec = spec
        self.backend = backend
        self._parallel = parallel
        self._lse_kernel = lse_kernel
        self.kernel = self._describe(anything=False) + (f" [ring blocks: {diffusers_lse.KERNEL}]" if lse_kernel else "")

    def _describe(self, anything: bool) -> str:
        """What diffusers dispatches to, named after its own template (the branch its config selects)."""
        p = self._parallel
        if p is None:
            path = "rank-local"
        elif p.ring > 1 and p.ulysses > 1:
            path = f"_templated_unified_attention U={p.ulysses} x R={p.ring}"
        elif p.ring > 1:
            path = f"TemplatedRingAttention R={p.ring}"
        else:
            path = f"TemplatedUlysses{'Anything' if anything else ''}Attention U={p.ulysses}"
        return f"diffusers {installed_version()} {self.backend}: {path}"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        attn_mask = kwargs.pop("attn_mask", None)
        seq_lens = kwargs.pop("seq_lens", None)
        if kwargs:
            raise Unsupported(f"diffusers' dispatch_attention_fn takes no {', '.join(sorted(kwargs))}")
        if self._lse_kernel and q.device.type != "cpu":
            raise Unsupported(
                f"the LSE kernel {diffusers_lse.KERNEL} runs on the CPU only; on {q.device.type} choose a "
                "diffusers backend that returns the LSE (_native_cudnn, flash)",
                kind=Refusal.RING_NEEDS_LSE,
            )
        if seq_lens is None:
            return self._dispatch(q, k, v, attn_mask, self._parallel.plain if self._parallel else None)
        if attn_mask is not None:
            raise Unsupported("seq_lens with an attn_mask: this adapter unpads q/k/v only (no contract sends both)")
        return self._varlen(q, k, v, list(seq_lens))

    def _varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Unpadded shards through ulysses_anything (diffusers gathers the sizes); zero rows back in."""
        p = self._parallel
        if p is not None and p.anything is None:
            raise Unsupported(
                f"diffusers takes uneven per-rank lengths through ulysses_anything, which needs ring_degree 1 (got {p.ring})"
            )
        position = dist.get_rank() if dist.is_initialized() else 0
        if len(seq_lens) <= position:
            raise ValueError(f"seq_lens {seq_lens} has no length for rank {position}")
        n = seq_lens[position]
        if p is not None and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise Unsupported(
                f"diffusers {installed_version()} has no backward for uneven lengths: "
                "TemplatedUlyssesAnythingAttention.backward raises NotImplementedError",
                kind=Refusal.NO_BACKWARD,
            )
        self.kernel = self._describe(anything=p is not None)
        out = self._dispatch(q[:, :n], k[:, :n], v[:, :n], None, p.anything if p else None)
        return torch.cat([out, out.new_zeros(out.shape[0], q.shape[1] - n, *out.shape[2:])], dim=1)

    def _dispatch(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, config: Any
    ) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        gqa = k.shape[2] != q.shape[2]
        try:
            if self._lse_kernel:
                return diffusers_lse.ring_attention(
                    q, k, v, attn_mask, self.spec.causal, self.spec.softmax_scale, gqa, config
                )
            return dispatch_attention_fn(
                q,
                k,
                v,
                attn_mask=attn_mask,
                is_causal=self.spec.causal,
                scale=self.spec.softmax_scale,
                enable_gqa=gqa,
                backend=self.backend,
                parallel_config=config,
            )
        except ValueError as exc:
            refused_mask = attn_mask is not None and not _at_least(installed_version() or MIN_VERSION, CP_MASK_SINCE)
            if config is None or not (self.spec.causal or gqa or refused_mask):
                raise
            # _templated_context_parallel_attention opens with `if is_causal: raise ValueError(...)`
            # and `if enable_gqa: raise ValueError(...)` (:2924-2927), and before 0.37 with the mask
            # guard (CP_MASK_SINCE), all before any collective.
            raise Unsupported(f"diffusers {installed_version()} under context parallelism: {exc}") from exc


class _Parallel:
    """This rank's diffusers ParallelConfig(s) on one device mesh: plain, and ulysses_anything for varlen."""

    def __init__(self, ulysses: int, ring: int, version: str) -> None:
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
        from torch.distributed.device_mesh import init_device_mesh

        self.ulysses, self.ring = ulysses, ring
        # nccl drives CUDA tensors; gloo is the CPU group (diffusers gathers sizes over it as "cpu").
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        device = (
            torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        )
        mesh = init_device_mesh(device_type, (ring, ulysses), mesh_dim_names=("ring", "ulysses"))

        def config(**options: bool) -> Any:
            parallel = ParallelConfig(
                context_parallel_config=ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, **options)
            )
            parallel.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
            return parallel

        self.plain = config()
        # Built on every rank alike (setup flattens the mesh): a rank's call must never be the first to.
        self.anything = config(ulysses_anything=True) if ring == 1 and "varlen" in capabilities_for(version) else None


class DiffusersTarget(Target):
    """``backend=NAME`` (a diffusers AttentionBackendName) picks the kernel family; default: diffusers' active one.
    ``lse_kernel=cpu_flash|none``: the kernel of the ring's blocks where ``native`` returns no LSE (default cpu_flash)."""

    name = "diffusers"
    overlay = "diffusers"  # variants (another backend, a test kernel) keep diffusers' version facts

    def version(self) -> str | None:
        return installed_version()

    def __init__(self, backend: str | None = None, lse_kernel: str = "cpu_flash") -> None:
        if lse_kernel not in diffusers_lse.LSE_KERNELS:
            raise ConfigError(
                f"{lse_kernel!r} is not an LSE kernel; valid: {', '.join(diffusers_lse.LSE_KERNELS)}",
                key="--target-arg lse_kernel",
            )
        self.lse_kernel = lse_kernel != "none"
        self.backend = backend
        self._version = installed_version()
        if backend is not None and self._version is not None:
            try:
                _check_backend_name(backend)
            except ParamError as exc:
                raise ConfigError(str(exc), key="--target-arg backend") from None
        self._parallel: _Parallel | None = None

    def capabilities(self) -> frozenset[str]:
        return capabilities_for(self._version) if self._version else _ALWAYS

    def check_backend(self, backend: str | None, sdpa_kernel: str | None) -> None:
        if self._version is None:
            return  # not installed: every case skips with that reason
        if backend is not None:
            _check_backend_name(backend)
        if sdpa_kernel is not None:
            raise ParamError(
                "sdpa_kernel",
                f"diffusers pins no SDPA kernel ({sdpa_kernel}); pick a backend (_native_math, _native_flash, ...)",
            )

    def unavailable_reason(self, device: str) -> str | None:
        if self._version is None:
            return NOT_INSTALLED
        if not _at_least(self._version, MIN_VERSION):
            return f"diffusers {self._version} has no ContextParallelConfig (it arrived in {MIN_VERSION}; pip install 'parity[diffusers]')"
        return None

    def init_parallel(self, ulysses_degree: int, ring_degree: int) -> None:
        self._parallel = None
        if ulysses_degree * ring_degree == 1:
            return  # diffusers refuses a CP config of degree 1; one rank is plain dispatch, as without CP
        assert self._version is not None
        _refuse_invalid_config(ulysses_degree, ring_degree)
        self._parallel = _Parallel(ulysses_degree, ring_degree, self._version)

    def destroy_parallel(self) -> None:
        # The mesh's gloo sub-groups are forgotten, not destroyed: destroying them made a later
        # new_group fail now and then (see reference_impl.parallel.state).
        self._parallel = None

    def make_attention(self, spec: AttentionSpec) -> DiffusersAttention:
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        if spec.sdpa_kernel is not None:  # check_backend refuses it in a case; never ignore it silently here
            raise Unsupported(f"diffusers pins no SDPA kernel ({spec.sdpa_kernel})", kind=Refusal.BACKEND_UNAVAILABLE)
        name = spec.backend or self.backend or _AttentionBackendRegistry.get_active_backend()[0].value
        enum = AttentionBackendName(name)
        _refuse_unavailable(enum)
        parallel = None if spec.skip_sequence_parallel else self._parallel
        if parallel is not None:
            if not _AttentionBackendRegistry._is_context_parallel_available(enum):
                raise Unsupported(
                    f"diffusers backend '{name}' does not support context parallelism (dispatch would ignore the config "
                    f"and attend rank-locally); compatible: {sorted(_AttentionBackendRegistry._supports_context_parallel)}",
                    kind=Refusal.BACKEND_UNAVAILABLE,
                )
            if parallel.ring > 1:
                # A case naming its backend gets that backend's own ring op (usp.ring_admission asks native's).
                lse_kernel = self.lse_kernel and spec.backend is None and name == "native"
                if not lse_kernel:
                    _refuse_ring_without_lse(name, spec)
                return DiffusersAttention(spec, name, parallel, lse_kernel)
        return DiffusersAttention(spec, name, parallel)


def _refuse_invalid_config(ulysses: int, ring: int) -> None:
    """diffusers' own validation of the degrees (rank-local, before the mesh), as a skip in its words.

    0.36's ContextParallelConfig refuses both degrees > 1 ("Unified Ulysses-Ring attention is not
    yet supported"); PR #12693 (first in 0.37.0) added the unified attention.
    """
    from diffusers.models._modeling_parallel import ContextParallelConfig

    try:
        ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses)
    except ValueError as exc:
        raise Unsupported(f"diffusers {installed_version()}: {exc}") from exc


def _refuse_unavailable(enum: Any) -> None:
    """diffusers' own availability check (missing flash-attn, sageattention, kernels, ...), as a skip."""
    from diffusers.models.attention_dispatch import _check_attention_backend_requirements

    try:
        _check_attention_backend_requirements(enum)
    except RuntimeError as exc:
        raise Unsupported(str(exc), kind=Refusal.BACKEND_UNAVAILABLE) from exc


def _refuse_ring_without_lse(name: str, spec: AttentionSpec) -> None:
    """Ask the backend's ring forward op for the LSE on a one-token tensor (rank-local, no collective)."""
    from diffusers.models import attention_dispatch

    op = getattr(attention_dispatch, _RING_FORWARD_OPS.get(name, ""), None)
    if op is None:
        return
    probe = torch.zeros(1, 1, 1, spec.head_dim, dtype=spec.dtype)
    try:
        op(None, probe, probe, probe, return_lse=True, _save_ctx=False)
    except ValueError as exc:
        raise Unsupported(
            f"diffusers {installed_version()} backend '{name}' cannot run ring attention, which merges partial "
            f"outputs by their log-sum-exp: {exc}",
            kind=Refusal.RING_NEEDS_LSE,
        ) from exc


def factory(backend: str | None = None, lse_kernel: str = "cpu_flash") -> DiffusersTarget:
    return DiffusersTarget(backend, lse_kernel)
