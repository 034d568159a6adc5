"""Which platform we run on: cuda, rocm (with its gcn arch), mps or cpu.

Everything platform-dependent asks ``current_platform`` rather than torch directly, so that
``PARITY_PLATFORM=rocm:gfx950`` (or ``cuda``, ``mps``, ``cpu``) can force a branch on any
machine: the ROCm and MPS code paths are then testable on a CPU-only CI runner. A forced
platform is *simulated*: the branch logic follows it, tensors stay where they are.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

PLATFORM_ENV = "PARITY_PLATFORM"
PLATFORM_KINDS = ("cuda", "rocm", "mps", "cpu")  # every kind a platform (and a case overlay) can name
_GCN_ARCH = re.compile(r"gfx[0-9a-f]{2,5}")


class PlatformSpecError(ValueError):
    """PARITY_PLATFORM holds something that is not ``cuda``, ``mps``, ``cpu``, ``rocm`` or ``rocm:gfxNNN``;
    ``reason`` says why without naming the variable (a caller that names it itself uses that)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{PLATFORM_ENV}: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class PlatformInfo:
    """A snapshot of the platform; ``simulated`` is True when forced through PARITY_PLATFORM."""

    kind: str
    gcn_arch: str | None
    device_name: str
    simulated: bool

    def is_cuda(self) -> bool:
        """NVIDIA CUDA only (ROCm answers False here, as in sglang)."""
        return self.kind == "cuda"

    def is_rocm(self) -> bool:
        return self.kind == "rocm"

    def is_cuda_alike(self) -> bool:
        """CUDA or ROCm: torch exposes both as the ``cuda`` device type."""
        return self.kind in ("cuda", "rocm")

    def is_mps(self) -> bool:
        return self.kind == "mps"

    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def device_type(self) -> str:
        """The torch device type of the *real* hardware (a simulated platform keeps CPU tensors)."""
        return _detect_real().device_type_real

    def label(self) -> str:
        """Short label for reports: ``rocm:gfx950 (simulated)``, ``cuda``."""
        base = f"{self.kind}:{self.gcn_arch}" if self.gcn_arch else self.kind
        return f"{base} (simulated)" if self.simulated else base


@dataclass(frozen=True)
class _RealPlatform:
    info: PlatformInfo
    device_type_real: str


_real_cache: _RealPlatform | None = None


def _detect_real() -> _RealPlatform:
    """Detect the hardware once; torch's device queries are not free and never change in-process."""
    global _real_cache
    if _real_cache is None:
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            if getattr(torch.version, "hip", None):
                arch = str(getattr(props, "gcnArchName", "")).split(":")[0] or None
                info = PlatformInfo("rocm", arch, props.name, False)
            else:
                info = PlatformInfo("cuda", None, props.name, False)
            _real_cache = _RealPlatform(info, "cuda")
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            _real_cache = _RealPlatform(PlatformInfo("mps", None, "Apple MPS", False), "mps")
        else:
            import platform as _py_platform

            name = _py_platform.processor() or _py_platform.machine() or "cpu"
            _real_cache = _RealPlatform(PlatformInfo("cpu", None, name, False), "cpu")
    return _real_cache


def parse_platform_spec(spec: str) -> tuple[str, str | None]:
    """Parse ``kind[:gcn_arch]``; anything else is a PlatformSpecError naming the variable and the valid values."""
    kind, colon, arch = spec.strip().lower().partition(":")
    if kind not in PLATFORM_KINDS:
        raise PlatformSpecError(
            f"unknown platform {kind!r} in {spec!r}; valid: {', '.join(PLATFORM_KINDS)} "
            "(rocm optionally with its arch, e.g. rocm:gfx950)"
        )
    if colon and kind != "rocm":
        raise PlatformSpecError(f"{spec!r}: only rocm takes an arch (e.g. rocm:gfx950)")
    if colon and not _GCN_ARCH.fullmatch(arch):
        raise PlatformSpecError(f"{spec!r}: {arch!r} is not a gcn arch (gfx followed by hex digits, e.g. gfx942)")
    return kind, (arch or None)


def detect_platform() -> PlatformInfo:
    """The platform in force now: the forced one when PARITY_PLATFORM is set, else the hardware."""
    spec = os.environ.get(PLATFORM_ENV, "").strip()
    real = _detect_real().info
    if not spec:
        return real
    kind, arch = parse_platform_spec(spec)
    if kind == real.kind and (arch is None or arch == real.gcn_arch):
        return real
    if kind == "rocm" and arch is None:
        arch = "gfx942"
    return PlatformInfo(kind, arch, f"{real.device_name} simulating {kind}", True)


class _CurrentPlatform:
    """Proxy that re-reads PARITY_PLATFORM on every call, so tests can force a platform per test."""

    def __getattr__(self, name: str):
        return getattr(detect_platform(), name)

    def __repr__(self) -> str:
        return f"current_platform<{detect_platform().label()}>"


current_platform: PlatformInfo = _CurrentPlatform()  # type: ignore[assignment]
