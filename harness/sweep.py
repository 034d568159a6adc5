"""Hardware-matrix sweeps: contracts × backend (× SDPA kernel on CUDA) × dtype × world size.

A sweep writes one JSON file per machine (schema ``parity.sweep/1``, read by
:mod:`harness.matrix`): the platform (device name, gcn arch, driver, torch version, whether
PARITY_PLATFORM simulated it), one cell per case run with its verdict and figures, and each
backend's kernel time and TFLOP/s on a standard shape, next to the USPAttention overhead and
the device's matmul rate. Kernel-dependent bitwise parity (DESIGN.md: torch's flash kernel is
not head-count invariant at every shape) is why the kernel is a column, not a footnote.
"""

from __future__ import annotations

import datetime as _dt
import json
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.cases import Case, with_overrides
from harness.contracts import get_contract
from harness.contracts.verdict import Verdict
from harness.matrix import SWEEP_SCHEMA


@dataclass(frozen=True)
class BackendColumn:
    """``torch_sdpa``, ``torch_sdpa:flash``, ``math``...: a backend and an optional pinned SDPA kernel."""

    backend: str
    kernel: str | None = None

    @classmethod
    def parse(cls, text: str) -> BackendColumn:
        backend, _, kernel = text.partition(":")
        return cls(backend, kernel or None)

    def __str__(self) -> str:
        return self.backend + (f":{self.kernel}" if self.kernel else "")


def default_backends(device: str) -> list[BackendColumn]:
    """Every backend; on CUDA also every pinned SDPA kernel (the kernel decides bitwise parity)."""
    from reference_impl.attention.backends import BACKENDS, SDPA_KERNELS

    columns = [BackendColumn(e.value) for e in BACKENDS]
    if device == "cuda":
        columns += [BackendColumn("torch_sdpa", k) for k in SDPA_KERNELS]
    return columns


def expand_matrix(
    cases: Sequence[Case], backends: Sequence[BackendColumn], dtypes: Sequence[str], world_sizes: Sequence[int] | None
) -> list[tuple[Case, BackendColumn]]:
    """One case per (case, backend, dtype) where the contract takes a backend and a dtype.

    Case files may already vary the dtype (a matrix axis): a case written for the dtype is used
    as it is, bounds and platform overrides included, and another case is re-typed only when no
    case of that dtype exists; duplicates (same parameters but the bound) run once.
    """
    selected = [
        c for c in cases
        if (not world_sizes or c.world_size in world_sizes)
        and {"backend", "dtype"} <= {p.name for p in get_contract(c.contract_id).params}
    ]
    cells = []
    seen: set[str] = set()
    for column in backends:
        for dtype in dtypes:
            native = [c for c in selected if c.params.get("dtype") == dtype]
            retyped = [c for c in selected if c.params.get("dtype") != dtype]
            for case in native + retyped:
                (varied,) = with_overrides([case], backend=column.backend, dtype=dtype, sdpa_kernel=column.kernel)
                shape = {k: v for k, v in varied.params.items() if "bound" not in k}
                key = json.dumps([case.contract_id, shape], sort_keys=True, default=str)
                if key not in seen:
                    seen.add(key)
                    cells.append((_renamed(varied, column, dtype), column))
    return cells


def _renamed(case: Case, column: BackendColumn, dtype: str) -> Case:
    return Case(f"{case.id}@{column}/{dtype}", case.contract_id, case.params, case.raw, case.source, case.description)


def platform_record() -> dict[str, Any]:
    """What identifies the machine a sweep ran on."""
    from harness.commands.doctor import diagnose

    info = diagnose()
    record = dict(info["platform"])
    record.update(torch=info["torch"], torch_cuda=info["torch_cuda"], torch_hip=info["torch_hip"], python=info["python"])
    record["driver"] = _driver_version() if torch.cuda.is_available() else None
    return record


def _driver_version() -> str | None:
    for cmd in (["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], ["rocm-smi", "--showdriverversion"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if out:
            return out.splitlines()[0].strip()
    return None


def cell_from_verdict(verdict: Verdict, column: BackendColumn) -> dict[str, Any]:
    params = verdict.params
    figures = {k: v for k, v in verdict.figures.items() if k != "traceback"}
    return {
        "case": verdict.case_id,
        "contract": verdict.contract_id,
        "backend": column.backend,
        "kernel": column.kernel,
        "kernel_ran": verdict.kernel,
        "dtype": params.get("dtype"),
        "world_size": params.get("world_size", 1),
        "status": verdict.status,
        "reason": verdict.reason,
        "bound": verdict.bound,
        "figures": figures,
    }


def run_sweep(
    cases: Sequence[Case],
    *,
    device: str,
    backends: Sequence[BackendColumn],
    dtypes: Sequence[str],
    world_sizes: Sequence[int] | None,
    target: str = "reference",
    kernels: bool = True,
    on_verdict: Callable[[Verdict], None] | None = None,
) -> dict[str, Any]:
    """Run the matrix and return the sweep document."""
    from harness.kernel_bench import matmul_tflops, time_backends, usp_overhead
    from harness.runner import PoolSet, run_cases

    matrix = expand_matrix(cases, backends, dtypes, world_sizes)
    with PoolSet(device) as pools:
        verdicts = run_cases([c for c, _ in matrix], target, device, pools=pools, on_verdict=on_verdict)
    document: dict[str, Any] = {
        "schema": SWEEP_SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "target": target,
        "device": device,
        "platform": platform_record(),
        "cells": [cell_from_verdict(v, column) for v, (_, column) in zip(verdicts, matrix)],
    }
    if kernels:
        on_gpu = device == "cuda"
        run_time = 0.5 if on_gpu else 0.2
        document["kernels"] = [t.to_dict() for dtype in (torch.bfloat16, torch.float16) for t in time_backends(
            device=device, dtype=dtype, min_run_time=run_time, **({} if on_gpu else {"shape": _cpu_shape()})
        )]
        document["usp_overhead"] = usp_overhead(device=device, min_run_time=run_time, **({} if on_gpu else {"shape": _cpu_shape()}))
        document["matmul"] = matmul_tflops(device, min_run_time=run_time)
    return document


def _cpu_shape():
    """The standard shape is too slow for a CPU sweep; the CPU times a quarter of the sequence."""
    from harness.kernel_bench import AttnShape

    return AttnShape(seq=1152)
