"""Hardware-matrix sweeps: contracts × backend (× SDPA kernel on CUDA) × dtype × world size.

A sweep writes one JSON file per machine (schema ``parity.sweep/1``, read by
:mod:`harness.sweep.matrix`): the platform (device name, gcn arch, driver, torch version, whether
PARITY_PLATFORM simulated it), one cell per case run with its verdict and figures, and each
backend's kernel time and TFLOP/s on a standard shape, next to the USPAttention overhead and
the device's matmul rate. Kernel-dependent bitwise parity (DESIGN.md: torch's flash kernel is
not head-count invariant at every shape) is why the kernel is a column, not a footnote.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from harness.baselines.platforms import machine_record
from harness.contracts.case import Case, with_overrides
from harness.contracts.params import DTYPES
from harness.contracts.registry import get_contract
from harness.contracts.runner import RunOptions, run_cases
from harness.ranks import PoolSet
from harness.results import CaseResult
from harness.sweep.matrix import SWEEP_SCHEMA


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


def default_backends(options: RunOptions) -> list[BackendColumn]:
    """The columns the target offers on this device (the reference: every backend, and on CUDA every pinned SDPA kernel)."""
    return [BackendColumn.parse(name) for name in options.load().backend_columns(options.device)]


def expand_matrix(
    cases: Sequence[Case], backends: Sequence[BackendColumn], dtypes: Sequence[str], world_sizes: Sequence[int] | None
) -> list[tuple[Case, BackendColumn]]:
    """One case per (case, backend, dtype) where the contract takes a backend and a dtype.

    Case files may already vary the dtype (a matrix axis): a case written for the dtype is used
    as it is, bounds and platform overrides included, and another case is re-typed only when no
    case of that dtype exists; duplicates (same parameters but the bound) run once.
    """
    selected = [
        c
        for c in cases
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
    return dataclasses.replace(case, id=f"{case.id}@{column}/{dtype}")


def cell_of(result: CaseResult, column: BackendColumn) -> dict[str, Any]:
    """One cell of the sweep file: a case result under a backend column."""
    return {
        "case": result.case_id,
        "contract": result.check,
        "backend": column.backend,
        "kernel": column.kernel,
        "kernel_ran": result.kernel,
        "dtype": result.params.get("dtype"),
        "world_size": result.world_size,
        "status": str(result.status),
        "reason": result.reason,
        "bound": result.bound,
        "figures": result.to_dict()["figures"],
    }


@dataclass(frozen=True)
class SweepOptions:
    """What ``parity sweep`` varies; empty ``backends`` means every column the target offers."""

    run: RunOptions = RunOptions()
    backends: tuple[BackendColumn, ...] = ()
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    world_sizes: tuple[int, ...] = ()
    kernels: bool = True

    def columns(self) -> list[BackendColumn]:
        return list(self.backends) or default_backends(self.run)


def run_sweep(
    cases: Sequence[Case], options: SweepOptions, on_result: Callable[[CaseResult], None] | None = None
) -> dict[str, Any]:
    """Run the matrix and return the sweep document."""
    from harness.targets.reference.kernels import matmul_tflops, time_backends, usp_overhead

    device = options.run.device
    matrix = expand_matrix(cases, options.columns(), options.dtypes, options.world_sizes)
    with PoolSet(device) as pools:
        # a sweep explores: a cell its backend cannot serve here is a skip with the reason, its outcome, not a failure
        explore = dataclasses.replace(options.run, allow_new_skips=True)
        results = run_cases([c for c, _ in matrix], explore, pools, release_pools=True, on_result=on_result)
    document: dict[str, Any] = {
        "schema": SWEEP_SCHEMA,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "target": options.run.target.name,
        "device": device,
        "platform": machine_record(),
        "cells": [cell_of(r, column) for r, (_, column) in zip(results, matrix)],
    }
    if options.kernels:
        on_gpu = device == "cuda"
        run_time = 0.5 if on_gpu else 0.2
        document["kernels"] = [
            t.to_dict()
            for dtype in (DTYPES[d] for d in options.dtypes)
            for t in time_backends(
                device=device, dtype=dtype, min_run_time=run_time, **({} if on_gpu else {"shape": _cpu_shape()})
            )
        ]
        document["usp_overhead"] = usp_overhead(
            device=device, min_run_time=run_time, **({} if on_gpu else {"shape": _cpu_shape()})
        )
        document["matmul"] = matmul_tflops(device, min_run_time=run_time)
    return document


def _cpu_shape():
    """The standard shape is too slow for a CPU sweep; the CPU times a quarter of the sequence."""
    from harness.targets.reference.kernels import AttnShape

    return AttnShape(seq=1152)
