"""Backend selection with an explicit precedence, and the configuration it reads.

Precedence, highest first: the explicit ``backend`` argument; the global force (``force=NAME``); a
component+role override (``dit.cross=NAME``); a component override (``video_vae=NAME``); the global
setting (``default=NAME`` or a bare ``NAME``); the layer's ``default_attention_backend``; the
platform default. The first four are strict (a choice the layer cannot honour is an error: a user
who named a backend must not silently get another); the next two fall back and record why. The
supported set filters every candidate; dtype is checked only on the fallback levels (a strictly
chosen fused backend runs at ``preferred_dtype`` and the caller casts, as the audio VAE does).
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from reference_impl.attention.backends import BACKENDS, AttentionBackend, AttentionBackendEnum
from reference_impl.platform import current_platform

_PLATFORM_PREFERENCE: dict[str, tuple[AttentionBackendEnum, ...]] = {
    "cuda": (AttentionBackendEnum.FA, AttentionBackendEnum.TORCH_SDPA, AttentionBackendEnum.MATH),
    "rocm": (AttentionBackendEnum.TORCH_SDPA, AttentionBackendEnum.MATH),
    "mps": (AttentionBackendEnum.TORCH_SDPA, AttentionBackendEnum.MATH),
    "cpu": (AttentionBackendEnum.TORCH_SDPA, AttentionBackendEnum.MATH),
}


@dataclass(frozen=True)
class BackendConfig:
    """Global force, global setting and per-component (and component.role) overrides."""

    force: AttentionBackendEnum | None = None
    default: AttentionBackendEnum | None = None
    overrides: Mapping[str, AttentionBackendEnum] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str | Mapping[str, str] | None) -> BackendConfig:
        """Parse ``"fa"``, ``"text_encoder=torch_sdpa,video_vae=fa,dit.cross=math,force=fa"`` or JSON.

        A JSON object (as a string or a mapping) uses the same keys. Unknown backend names raise
        ValueError listing the valid ones.
        """
        if spec is None:
            return cls()
        if isinstance(spec, str):
            text = spec.strip()
            if not text:
                return cls()
            if text.startswith("{"):
                try:
                    spec = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"attention backend config is not valid JSON: {exc}") from exc
            elif "=" not in text:
                return cls(default=AttentionBackendEnum.parse(text))
            else:
                pairs = {}
                for item in filter(None, (p.strip() for p in text.split(","))):
                    key, sep, value = item.partition("=")
                    if not sep or not key.strip():
                        raise ValueError(f"attention backend config item {item!r} is not KEY=NAME")
                    pairs[key.strip()] = value.strip()
                spec = pairs
        if not isinstance(spec, Mapping):
            raise ValueError(f"attention backend config must be a string or an object, got {type(spec).__name__}")
        force = default = None
        overrides: dict[str, AttentionBackendEnum] = {}
        for key, value in spec.items():
            backend = AttentionBackendEnum.parse(value)
            if key == "force":
                force = backend
            elif key in ("default", "*", "global"):
                default = backend
            else:
                overrides[key] = backend
        return cls(force=force, default=default, overrides=overrides)


_DEFAULT_CONFIG = BackendConfig()  # frozen: one shared default is safe
_config: contextvars.ContextVar[BackendConfig] = contextvars.ContextVar(
    "parity_backend_config", default=_DEFAULT_CONFIG
)
_component: contextvars.ContextVar[str | None] = contextvars.ContextVar("parity_attention_component", default=None)


def configure_attention_backends(spec: str | Mapping[str, str] | BackendConfig | None) -> BackendConfig:
    """Set the process-wide backend configuration (None resets it)."""
    config = spec if isinstance(spec, BackendConfig) else BackendConfig.parse(spec)
    _config.set(config)
    return config


def current_backend_config() -> BackendConfig:
    return _config.get()


@contextmanager
def attention_backend_config(spec: str | Mapping[str, str] | BackendConfig | None) -> Iterator[BackendConfig]:
    """Scope a backend configuration to a block (tests, one contract run)."""
    config = spec if isinstance(spec, BackendConfig) else BackendConfig.parse(spec)
    token = _config.set(config)
    try:
        yield config
    finally:
        _config.reset(token)


@contextmanager
def attention_component(name: str) -> Iterator[None]:
    """Layers built inside this block belong to component ``name`` (``text_encoder``, ``video_vae``...)."""
    token = _component.set(name)
    try:
        yield
    finally:
        _component.reset(token)


def current_component() -> str | None:
    return _component.get()


class BackendRefused(ValueError):
    """A strictly chosen backend (explicit, forced, component override) cannot serve this layer."""


@dataclass(frozen=True)
class BackendSelection:
    """The chosen backend, the precedence level that chose it, and why earlier levels were passed over."""

    backend: type[AttentionBackend]
    level: str
    notes: tuple[str, ...] = ()

    @property
    def enum(self) -> AttentionBackendEnum:
        return self.backend.enum


def _refusal(
    backend: AttentionBackendEnum,
    head_size: int,
    dtype: torch.dtype | None,
    supported: frozenset[AttentionBackendEnum] | None,
    check_dtype: bool,
) -> str | None:
    """Why ``backend`` cannot serve this layer, or None when it can."""
    cls = BACKENDS[backend]
    if supported is not None and backend not in supported:
        return f"{backend.value} is not in the layer's supported set ({', '.join(sorted(b.value for b in supported))})"
    reason = cls.unavailable_reason()
    if reason:
        return reason
    if not cls.supports_head_size(head_size):
        return f"{backend.value} does not support head size {head_size}"
    if check_dtype and dtype is not None and not cls.supports_dtype(dtype):
        return f"{backend.value} does not support {dtype}"
    return None


def select_attn_backend(
    head_size: int,
    dtype: torch.dtype | None,
    supported_attention_backends: Iterable[AttentionBackendEnum | str] | None = None,
    default_attention_backend: AttentionBackendEnum | str | None = None,
    is_cross_attention: bool = False,
    *,
    backend: AttentionBackendEnum | str | None = None,
    component: str | None = None,
) -> BackendSelection:
    """Apply the precedence of the module docstring and say which level decided."""
    supported = (
        frozenset(AttentionBackendEnum.parse(b) for b in supported_attention_backends)
        if supported_attention_backends is not None
        else None
    )
    config = current_backend_config()
    component = component if component is not None else current_component()
    role = "cross" if is_cross_attention else "self"
    strict: list[tuple[str, AttentionBackendEnum | None]] = [
        ("explicit", AttentionBackendEnum.parse(backend) if backend is not None else None),
        ("force", config.force),
        (f"component {component}.{role}", config.overrides.get(f"{component}.{role}") if component else None),
        (f"component {component}", config.overrides.get(component) if component else None),
    ]
    for level, choice in strict:
        if choice is None:
            continue
        reason = _refusal(choice, head_size, dtype, supported, check_dtype=False)
        if reason:
            raise BackendRefused(f"attention backend {choice.value!r} chosen by {level} cannot be honoured: {reason}")
        return BackendSelection(BACKENDS[choice], level)

    notes: list[str] = []
    soft: list[tuple[str, AttentionBackendEnum | None]] = [
        ("global setting", config.default),
        ("layer default", AttentionBackendEnum.parse(default_attention_backend) if default_attention_backend else None),
    ]
    for level, choice in soft:
        if choice is None:
            continue
        reason = _refusal(choice, head_size, dtype, supported, check_dtype=True)
        if reason is None:
            return BackendSelection(BACKENDS[choice], level, tuple(notes))
        notes.append(f"{level} {choice.value} passed over: {reason}")

    for choice in _PLATFORM_PREFERENCE[current_platform.kind]:
        reason = _refusal(choice, head_size, dtype, supported, check_dtype=True)
        if reason is None:
            return BackendSelection(BACKENDS[choice], "platform default", tuple(notes))
        notes.append(f"platform default {choice.value} passed over: {reason}")
    raise ValueError("no attention backend can serve this layer: " + "; ".join(notes))


def get_attn_backend(*args: Any, **kwargs: Any) -> type[AttentionBackend]:
    """sglang-compatible entry point, same arguments as :func:`select_attn_backend`:
    ``get_attn_backend(head_size, dtype, supported_attention_backends=None,
    default_attention_backend=None, is_cross_attention=False, *, backend=None, component=None)``.
    Returns the backend class only; ``select_attn_backend`` also says which level chose it.
    """
    return select_attn_backend(*args, **kwargs).backend
