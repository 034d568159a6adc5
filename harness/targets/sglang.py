"""sglang's multimodal_gen ``USPAttention`` as a target, driven through sglang's own parallel state.

Each rank builds sglang's groups on the live default process group, its layer with sglang's
constructor and selector, and calls it in sglang's forward context: nothing of sglang is
re-implemented or mocked. The parent learns the capabilities from the installed version alone.
sglang's refusals keep its own text and become a :class:`~harness.targets.base.Refusal` (ring at
construction: ``ring_needs_lse``; a mask with replicated tokens: ``mask_with_replicated``; other
NotImplementedErrors: ``unsupported``); anything else is a bug of the stack and fails the case.
``--target-arg layer=MODULE:CLASS`` gates a patched layer before a release. The mapping: docs/targets/attention.md.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import warnings
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import InvalidVersion, Version

from harness.errors import ConfigError, ParamError
from harness.targets.base import AttentionSpec, Refusal, Target, Unsupported

DISTRIBUTION = "sglang"
LAYER_MODULE = "sglang.multimodal_gen.runtime.layers.attention.layer"
INSTALL_HINT = "on a CPU-only machine run scripts/install-sglang-cpu.sh; elsewhere pip install 'sglang[diffusion]'"

# The capabilities every release this adapter knows has, and those that came later. The first
# release of each PR was established by reading layer.py of each sglang wheel on PyPI
# (scripts/sglang_cpu/README.md, "Version facts").
_BASE = frozenset(
    {"ulysses", "ring", "gqa", "causal", "replicated_prefix", "replicated_suffix", "replicated_kv_prefix", "mask"}
)
SINCE: dict[str, tuple[Version, str]] = {
    "varlen": (Version("0.5.18"), "PR #33923 added the seq_lens entry"),
    "backend_choice": (Version("0.5.20"), "USPAttention takes required_attention_backend"),
    "masked_replicated_prefix": (Version("0.5.20"), "PR #36735 made a key mask with a replicated prefix legal"),
    "ring_replicated": (
        Version("0.5.18"),
        "replicated tokens keyed on the whole SP group: under ring the replicated K/V "
        "is one more LSE-merged partial (0.5.17 raised NotImplementedError under ring)",
    ),
}
OLDEST = Version(
    "0.5.16"
)  # USPAttention as this adapter calls it (forward's replicated kinds); run: docs/targets/versions.md
# How USPAttention.__init__ words its ring refusal (no backend LSE), newest first: (first release, words).
# PR #33928 (first in 0.5.18) made ring admission a backend capability; before it a list of backends was named.
RING_REFUSALS: tuple[tuple[Version, str], ...] = (
    (Version("0.5.18"), "(see AttentionBackend.supports_ring_rotation)"),
    (OLDEST, "Ring Attention is only supported for FlashAttention or SageAttention backends"),
)

_REPLICATED = ("num_replicated_prefix", "num_replicated_suffix", "num_replicated_kv_prefix")
_FORWARD_KWARGS = frozenset({"attn_mask", "seq_lens", *_REPLICATED})
_CONSTRUCTOR_ARGS = ("num_heads", "head_size", "num_kv_heads", "softmax_scale", "causal", "skip_sequence_parallel")


def installed_version() -> Version | None:
    """The installed sglang's version (metadata only: nothing is imported), None when absent."""
    try:
        return Version(distribution_version(DISTRIBUTION))
    except (PackageNotFoundError, InvalidVersion):
        return None


def capabilities_for(version: Version) -> frozenset[str]:
    return _BASE | {name for name, (since, _) in SINCE.items() if version >= since}


def is_ring_refusal(version: Version | None, message: str) -> bool:
    """Whether ``message`` is ``version``'s ring refusal at construction (:data:`RING_REFUSALS`)."""
    words = next((words for since, words in RING_REFUSALS if version is not None and version >= since), None)
    return words is not None and words in message


@functools.cache
def import_error() -> str | None:
    """Why sglang's attention layer does not import here, or None (the import is paid once per process)."""
    try:
        with warnings.catch_warnings():  # "Only CUDA ... support AWQ/GGUF": platform notices, one per rank
            warnings.simplefilter("ignore", UserWarning)
            importlib.import_module(LAYER_MODULE)
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return f"sglang {installed_version()} is installed but {LAYER_MODULE} does not import: {type(exc).__name__}: {exc} ({INSTALL_HINT})"
    return None


def _sglang() -> dict[str, ModuleType]:
    """sglang's modules this adapter calls (imported in the rank, on first use)."""
    reason = import_error()
    if reason:
        raise Unsupported(reason, kind=Refusal.BACKEND_UNAVAILABLE)
    base = "sglang.multimodal_gen.runtime"
    names = {
        "layer": LAYER_MODULE,
        "state": f"{base}.distributed.parallel_state",
        "context": f"{base}.managers.forward_context",
        "server_args": f"{base}.server_args.server_args",
    }
    return {key: importlib.import_module(name) for key, name in names.items()}


def load_layer_class(spec: str) -> type:
    """``MODULE:CLASS`` as a class taking sglang's constructor arguments; ConfigError names the argument."""
    where = "--target-arg layer"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise ConfigError(
            f"{spec!r} must be MODULE:CLASS (e.g. tests.targets.sglang_rotated_suffix:RotatedSuffixUSPAttention)",
            key=where,
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import module {module_name!r}: {exc}", key=where) from exc
    cls = getattr(module, attr, None)
    if not inspect.isclass(cls):
        raise ConfigError(f"module {module_name!r} has no class {attr!r}", key=where)
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{spec}: cannot read its constructor's signature: {exc}", key=where) from exc
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [name for name in _CONSTRUCTOR_ARGS if name not in params and not takes_any]
    if missing or not callable(getattr(cls, "forward", None)):
        what = f"its constructor lacks {', '.join(missing)}" if missing else "it has no forward()"
        raise ConfigError(f"{spec} does not look like sglang's USPAttention: {what}", key=where)
    return cls


class SglangAttention:
    """The layer called inside sglang's forward context; varlen shards unpadded; refusals mapped to kinds."""

    def __init__(self, layer: torch.nn.Module, mods: dict[str, ModuleType], version: Version | None) -> None:
        self.layer = layer
        self._mods = mods
        self._version = version
        self.backend = layer.backend.name.lower()
        self.kernel = (
            f"sglang {version} {type(layer).__name__}: {layer.backend.name} ({type(layer.attn_impl).__name__})"
        )

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        unknown = set(kwargs) - _FORWARD_KWARGS
        if unknown:
            raise Unsupported(f"the sglang target passes no {', '.join(sorted(unknown))}")
        if kwargs.get("seq_lens") is not None:
            return self._varlen(q, k, v, kwargs["seq_lens"])
        return self._forward(q, k, v, **kwargs)

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        try:
            with self._mods["context"].set_forward_context(current_timestep=0, attn_metadata=None):
                return self.layer(q, k, v, **kwargs)
        except NotImplementedError as exc:  # sglang raises these before any collective, on every rank
            replicated = kwargs.get("attn_mask") is not None and any(kwargs.get(key) for key in _REPLICATED)
            raise Unsupported(
                f"sglang {self._version}: {exc}", "mask_with_replicated" if replicated else "unsupported"
            ) from exc

    def _varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """sglang takes each rank's valid rows only: strip the padding, add zero rows back."""
        mine = seq_lens[self._mods["state"].get_sp_parallel_rank()]
        out = self._forward(q[:, :mine], k[:, :mine], v[:, :mine], seq_lens=list(seq_lens))
        return torch.cat([out, out.new_zeros(out.shape[0], q.shape[1] - mine, *out.shape[2:])], dim=1)


class SglangTarget(Target):
    """sglang's ``USPAttention`` (or ``layer=MODULE:CLASS``) on sglang's parallel state."""

    name = "sglang"

    def __init__(self, layer: str | None = None) -> None:
        self._layer_cls: type | None = load_layer_class(layer) if layer else None
        self._ring_degree = 1

    def capabilities(self) -> frozenset[str]:
        version = installed_version()
        return capabilities_for(version) if version is not None else frozenset()

    def check_backend(self, backend: str | None, sdpa_kernel: str | None) -> None:
        if sdpa_kernel is not None:
            raise ParamError("sdpa_kernel", f"sglang cannot pin torch SDPA to one kernel ({sdpa_kernel})")
        if backend is None or installed_version() is None or import_error() is not None:
            return  # sglang cannot run here: every case skips with that reason
        members = _sglang()["layer"].AttentionBackendEnum.__members__
        if backend.upper() not in members:
            names = ", ".join(m.lower() for m in members)
            raise ParamError(
                "backend", f"sglang {installed_version()} has no attention backend {backend!r}; its backends: {names}"
            )

    def version(self) -> str | None:
        version = installed_version()
        if version is None:
            return None
        return (
            str(version)
            if self._layer_cls is None
            else f"{version}, layer {self._layer_cls.__module__}:{self._layer_cls.__qualname__}"
        )

    def unavailable_reason(self, device: str) -> str | None:
        version = installed_version()
        if version is None:
            return f"sglang is not installed ({INSTALL_HINT})"
        if version < OLDEST:
            return f"sglang {version} is older than {OLDEST}, the oldest USPAttention this adapter is written for"
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            return f"the sglang target runs on cpu or cuda, not {kind}"
        if kind == "cuda" and not torch.cuda.is_available():
            return "device cuda but torch sees no CUDA device"
        return import_error()  # the one question metadata cannot answer: this imports sglang, once per process

    def init_parallel(self, ulysses_degree: int, ring_degree: int) -> None:
        self._parallel_state(ulysses_degree, ring_degree)

    def destroy_parallel(self) -> None:
        self._ring_degree = 1
        if LAYER_MODULE not in sys.modules:  # sglang never imported in this process: nothing to forget
            return
        state = _sglang()["state"]
        if state.model_parallel_is_initialized():
            state.destroy_model_parallel()

    def _parallel_state(self, ulysses_degree: int, ring_degree: int) -> None:
        """sglang's groups on the default group: SP over U×R ranks, data parallel over the rest (every rank calls it)."""
        mods = _sglang()
        _set_server_args(mods["server_args"])
        state, backend = mods["state"], dist.get_backend()
        if state.model_parallel_is_initialized():
            state.destroy_model_parallel()
        rank, world, sp = dist.get_rank(), dist.get_world_size(), ulysses_degree * ring_degree
        state.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend=backend)
        state.initialize_model_parallel(
            data_parallel_size=world // sp,
            sequence_parallel_degree=sp,
            ulysses_degree=ulysses_degree,
            ring_degree=ring_degree,
            backend=backend,
        )
        self._ring_degree = ring_degree

    def make_attention(self, spec: AttentionSpec) -> SglangAttention:
        mods = _sglang()
        if not mods["state"].model_parallel_is_initialized():
            # sglang always runs on its parallel state, even on one rank (its masked path reads the SP
            # size before honouring skip_sequence_parallel): outside SP, each rank is an SP group of one.
            # Creating the groups is collective; contracts build their single-rank reference on every rank.
            self._parallel_state(1, 1)
        if spec.sdpa_kernel:  # check_backend refuses it in a case; never ignore it silently here
            raise Unsupported(f"sglang cannot pin torch SDPA to one kernel ({spec.sdpa_kernel})", "backend_unavailable")
        required = None if spec.backend is None else mods["layer"].AttentionBackendEnum[spec.backend.upper()]  # checked
        cls = self._layer_cls or mods["layer"].USPAttention
        chosen = {} if required is None else {"required_attention_backend": required}
        try:
            layer = cls(
                spec.num_heads,
                spec.head_dim,
                num_kv_heads=spec.num_kv_heads,
                softmax_scale=spec.softmax_scale,
                causal=spec.causal,
                skip_sequence_parallel=spec.skip_sequence_parallel,
                **chosen,
            )
        except RuntimeError as exc:
            # sglang's ring admission, at construction, in the installed release's words. Any other
            # error (an OOM, a patched layer's bug, a ring refusal of a rank-local layer) is the
            # layer's failure, not a refusal.
            if (
                self._ring_degree > 1
                and not spec.skip_sequence_parallel
                and is_ring_refusal(installed_version(), str(exc))
            ):
                raise Unsupported(f"sglang {installed_version()}: {exc}", "ring_needs_lse") from exc
            raise
        except ValueError as exc:
            if required is not None:  # the selector cannot serve the requested backend here
                raise Unsupported(f"sglang {installed_version()}: {exc}", "backend_unavailable") from exc
            raise
        if required is not None and layer.backend != required:  # sglang's selector fell back to another backend
            raise Unsupported(
                f"sglang {installed_version()} runs {layer.backend.name} when asked for {required.name} here",
                "backend_unavailable",
            )
        return SglangAttention(layer, mods, installed_version())


def _set_server_args(module: ModuleType) -> None:
    """sglang's layers read global server args; set a minimal set once, as sglang's unit tests do (never replace a real one)."""
    try:
        module.get_global_server_args()
    except ValueError:
        module.set_global_server_args(_MinimalServerArgs())


class _MinimalServerArgs:
    """The server arguments USPAttention reads: no K/V-gather SP, no forced backend."""

    kv_gather_degree = 1
    sp_split_auto = False
    attention_backend = None


def factory(layer: str | None = None) -> SglangTarget:
    return SglangTarget(layer)
