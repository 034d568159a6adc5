"""Choosing the per-platform overlay file for the machine we run on.

Thresholds and perf baselines are both stored as a base file plus one overlay per platform
(``consistency_thresholds/h100.json``, ``baselines/platforms/h100.json``). The device name the
runtime reports is noisy ("NVIDIA H100 80GB HBM3", "AMD Instinct MI300X", "gfx942"), so it is
normalised to tokens and the most specific overlay whose name is a token prefix wins: a device
"NVIDIA H100 80GB HBM3" uses ``h100_80gb_hbm3.json`` if present, else ``h100_80gb.json``, else
``h100.json``. Vendor words carry no information and are dropped.
"""

from __future__ import annotations

import platform as _py_platform
import re
from pathlib import Path
from typing import Any

from harness.files.reading import is_present

__all__ = ["normalize_device_name", "find_overlay", "platform_name", "hardware_name", "machine_record"]

_VENDOR_WORDS = frozenset({"nvidia", "amd", "intel", "instinct", "radeon", "geforce", "tesla", "apple", "corporation"})


def normalize_device_name(name: str) -> str:
    """``"NVIDIA A100-SXM4-80GB"`` -> ``"a100_sxm4_80gb"``; ``"AMD Instinct MI300X"`` -> ``"mi300x"``."""
    tokens = [t for t in re.split(r"[^0-9a-z]+", name.lower()) if t and t not in _VENDOR_WORDS]
    return "_".join(tokens)


def find_overlay(directory: str | Path, device_name: str) -> Path | None:
    """The most specific ``<prefix>.json`` in ``directory`` for this device, or None.

    None means "no platform file": callers use the base file alone, which is the right behaviour
    for a new platform until someone measures it (see the gfx1250 overlay's comment in sglang).
    A candidate that exists but is not a regular file (a directory, a FIFO, a dangling symlink)
    is a ConfigError: silently gating without the overlay would pass what it should fail.
    """
    normalized = normalize_device_name(device_name)
    if not normalized:
        return None
    tokens = normalized.split("_")
    base = Path(directory)
    for n in range(len(tokens), 0, -1):
        candidate = base / ("_".join(tokens[:n]) + ".json")
        if is_present(candidate):
            return candidate
    return None


def platform_name(device: str = "cpu") -> str:
    """The overlay name of the hardware that ``device`` (``cpu`` or ``cuda``) runs on.

    CUDA: the normalised GPU name (``"NVIDIA H200"`` -> ``h200``); ROCm: the gfx arch, as sglang
    names its AMD overlays (``gfx942``); CPU: ``cpu_<machine>`` (``cpu_x86_64``). The real
    hardware, never a platform forced through ``PARITY_PLATFORM``: timings and numerics come
    from the silicon. Results files record it (``platform``), so recalibration can sort results
    from several machines into their overlays.
    """
    import torch

    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        arch = str(getattr(props, "gcnArchName", "")).split(":")[0]
        if getattr(torch.version, "hip", None) and arch:
            return normalize_device_name(arch)
        return normalize_device_name(props.name)
    if device == "cpu":
        return "cpu_" + (normalize_device_name(_py_platform.machine()) or "unknown")
    raise ValueError(f"no platform name for device {device!r}; valid: cpu, cuda[:N]")


def hardware_name(device: str = "cpu") -> str:
    """A human-readable name of the hardware (a perf overlay's ``metadata.hardware``)."""
    import os

    import torch

    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(torch.device(device)))
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or _py_platform.processor() or _py_platform.machine()} ({os.cpu_count()} logical CPUs)"


def machine_record() -> dict[str, Any]:
    """What identifies the machine a run happened on (a sweep file's ``platform``; ``parity doctor`` shows it)."""
    import platform as py

    import torch

    from reference_impl.platform import current_platform as p

    record: dict[str, Any] = {
        "kind": p.kind,
        "label": p.label(),
        "simulated": p.simulated,
        "gcn_arch": p.gcn_arch,
        "device_name": p.device_name,
    }
    record.update(
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        torch_hip=getattr(torch.version, "hip", None),
        python=py.python_version(),
    )
    record["driver"] = _driver_version() if torch.cuda.is_available() else None
    return record


def _driver_version() -> str | None:
    import subprocess

    for cmd in (
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        ["rocm-smi", "--showdriverversion"],
    ):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if out:
            return out.splitlines()[0].strip()
    return None
