"""Merge sweep files from several machines into one matrix (markdown or HTML).

Rows are contract × dtype; columns are platform × backend (the SDPA kernel when pinned).
A cell reads ``pass``/``FAIL``/``skip`` with its figure: ``=`` for bitwise, else the max abs
error. Platforms forced through PARITY_PLATFORM are labelled *simulated*.

Every value a table shows is validated when the file is read (:func:`load_sweep`), so a
corrupt or hand-edited sweep is a ConfigError naming the file and the key, never a traceback
halfway through rendering or a cell that reads "pass" for a NaN.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import ConfigError
from harness.files.jsonio import expect_int, expect_known_keys, expect_number, expect_object, expect_str, read_json
from harness.report.format import outcome_cell
from harness.results import Status

SWEEP_SCHEMA = "parity.sweep/1"
_NON_FINITE = ("nan", "inf", "-inf")  # how a results figure records a non-finite float (harness.results.json_safe)
# the keys harness.sweep.sweep writes: any other is a misspelling or a hand edit, refused naming the nearest
_DOCUMENT_KEYS = ("schema", "created", "target", "device", "platform", "cells", "kernels", "usp_overhead", "matmul")
_PLATFORM_KEYS = (
    "kind",
    "label",
    "simulated",
    "gcn_arch",
    "device_name",
    "torch",
    "torch_cuda",
    "torch_hip",
    "python",
    "driver",
)
_CELL_KEYS = (
    "case",
    "contract",
    "backend",
    "kernel",
    "kernel_ran",
    "dtype",
    "world_size",
    "status",
    "reason",
    "bound",
    "figures",
)
_KERNEL_KEYS = ("backend", "kernel", "dtype", "shape", "median_ms", "tflops", "skipped")


@dataclass(frozen=True)
class Sweep:
    path: str
    platform: dict
    cells: list[dict]
    kernels: list[dict]
    extras: dict

    @property
    def platform_label(self) -> str:
        p = self.platform
        label = p.get("label", p.get("kind", "?"))
        return label if p.get("simulated") else f"{label} · {p.get('device_name') or '?'}"


def _optional(value: Any, path: str | Path, key: str, kind: str) -> None:
    """``value`` is null or of ``kind``: "str", "bool" or "number" (finite, >= 0)."""
    if value is None:
        return
    if kind == "str":
        expect_str(value, path, key)
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"expected true, false or null, got {value!r}", path=path, key=key)
    else:
        expect_number(value, path, key, lo=0.0)


def _check_cell(cell: Any, path: str | Path, key: str) -> None:
    cell = expect_object(cell, path, key)
    expect_known_keys(cell, _CELL_KEYS, path, key)
    for name in ("contract", "dtype", "backend", "status"):
        if not isinstance(cell.get(name), str) or not cell[name]:
            raise ConfigError("missing or not a non-empty string", path=path, key=f"{key}.{name}")
    if cell["status"] not in {str(s) for s in Status}:
        raise ConfigError(
            f"status must be one of {[str(s) for s in Status]}, got {cell['status']!r}", path=path, key=f"{key}.status"
        )
    _optional(cell.get("kernel"), path, f"{key}.kernel", "str")
    if "world_size" in cell:
        expect_int(cell["world_size"], path, f"{key}.world_size", lo=1)
    figures = cell.get("figures")
    if figures is None:
        return
    figures = expect_object(figures, path, f"{key}.figures")
    _optional(figures.get("bitwise"), path, f"{key}.figures.bitwise", "bool")
    max_abs = figures.get("max_abs")
    if max_abs in _NON_FINITE:
        if cell["status"] == "passed":
            raise ConfigError(
                f"a passed cell with max_abs {max_abs!r}: NaN/Inf never pass", path=path, key=f"{key}.figures.max_abs"
            )
    else:
        _optional(max_abs, path, f"{key}.figures.max_abs", "number")


def _check_kernel(row: Any, path: str | Path, key: str) -> None:
    row = expect_object(row, path, key)
    expect_known_keys(row, _KERNEL_KEYS, path, key)
    for name in ("backend", "dtype", "shape"):
        expect_str(row.get(name), path, f"{key}.{name}")
    for name, kind in (("kernel", "str"), ("skipped", "str"), ("median_ms", "number"), ("tflops", "number")):
        _optional(row.get(name), path, f"{key}.{name}", kind)


def load_sweep(path: str | Path) -> Sweep:
    """Read and validate a sweep file, every value a matrix renders included; errors name the file and the key."""
    return parse_sweep(read_json(path), path)


def parse_sweep(data: Any, path: str | Path = "<this run>") -> Sweep:
    """Validate a sweep document (read from a file, or just made by ``parity sweep``)."""
    data = expect_object(data, path, "")
    if data.get("schema") != SWEEP_SCHEMA:
        raise ConfigError(f"not a parity sweep file (expected schema {SWEEP_SCHEMA!r})", path=path, key="schema")
    expect_known_keys(data, _DOCUMENT_KEYS, path, "")
    platform = expect_object(data.get("platform"), path, "platform")
    expect_known_keys(platform, _PLATFORM_KEYS, path, "platform")
    for name in ("label", "kind", "device_name"):
        _optional(platform.get(name), path, f"platform.{name}", "str")
    _optional(platform.get("simulated"), path, "platform.simulated", "bool")
    if not isinstance(data.get("cells"), list):
        raise ConfigError("must be an array", path=path, key="cells")
    for i, cell in enumerate(data["cells"]):
        _check_cell(cell, path, f"cells.{i}")
    kernels = data.get("kernels", [])
    if not isinstance(kernels, list):
        raise ConfigError("must be an array", path=path, key="kernels")
    for i, row in enumerate(kernels):
        _check_kernel(row, path, f"kernels.{i}")
    extras = {k: v for k, v in data.items() if k not in ("schema", "platform", "cells", "kernels")}
    return Sweep(str(path), platform, data["cells"], kernels, extras)


def _column(sweep: Sweep, cell: dict) -> str:
    backend = cell["backend"] + (f":{cell['kernel']}" if cell.get("kernel") else "")
    return f"{sweep.platform_label} | {backend}"


def _severity(cell: dict) -> tuple[int, int, float]:
    """Order cells worst first: a failure, then a run (non-bitwise, larger error), then a skip."""
    rank = {"failed": 2, "passed": 1}.get(cell["status"], 0)
    figures = cell.get("figures") or {}
    max_abs = figures.get("max_abs")
    return rank, int(not figures.get("bitwise")), float(max_abs) if isinstance(max_abs, (int, float)) else 0.0


def build_matrix(sweeps: Sequence[Sweep]) -> tuple[list[str], list[str], dict[tuple[str, str], list[dict]]]:
    """Rows, columns and the cells of each slot (several cases, e.g. world sizes, share a slot)."""
    rows: list[str] = []
    cols: list[str] = []
    cells: dict[tuple[str, str], list[dict]] = {}
    for sweep in sweeps:
        for cell in sweep.cells:
            row = f"{cell['contract']} · {cell['dtype']}"
            col = _column(sweep, cell)
            if row not in rows:
                rows.append(row)
            if col not in cols:
                cols.append(col)
            cells.setdefault((row, col), []).append(cell)
    return sorted(rows), cols, cells


def _summarize(slot: list[dict]) -> str:
    """The worst cell of a slot, and how many more it stands for."""
    if not slot:
        return ""
    worst = max(slot, key=_severity)
    return outcome_cell(worst["status"], worst.get("figures")) + (f" (+{len(slot) - 1})" if len(slot) > 1 else "")


LEGEND = (
    "`=` bitwise with one rank; a number is the max abs error against one rank; `(+n)`: n more "
    "cases (world sizes, shapes) in the same cell, the worst one shown; *simulated*: platform "
    "branches forced through PARITY_PLATFORM on another machine."
)


def render_markdown(sweeps: Sequence[Sweep]) -> str:
    rows, cols, cells = build_matrix(sweeps)
    lines = ["| contract · dtype | " + " | ".join(c.replace("|", "/") for c in cols) + " |"]
    lines.append("| --- |" + " --- |" * len(cols))
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(_summarize(cells.get((row, c), [])) for c in cols) + " |")
    lines.append("")
    lines.append(LEGEND)
    lines.append("")
    lines.extend(_kernel_lines(sweeps))
    return "\n".join(lines) + "\n"


def _kernel_lines(sweeps: Iterable[Sweep]) -> list[str]:
    out = []
    for sweep in sweeps:
        if not sweep.kernels:
            continue
        out.append(f"Kernels on {sweep.platform_label}:")
        out.append("")
        out.append("| backend | dtype | shape | ms | TFLOP/s | note |")
        out.append("| --- | --- | --- | --- | --- | --- |")
        for k in sweep.kernels:
            name = k["backend"] + (f":{k['kernel']}" if k.get("kernel") else "")
            ms = f"{k['median_ms']:.3f}" if k.get("median_ms") is not None else "-"
            tf = f"{k['tflops']:.1f}" if k.get("tflops") is not None else "-"
            out.append(f"| {name} | {k['dtype']} | {k['shape']} | {ms} | {tf} | {k.get('skipped') or ''} |")
        out.append("")
    return out


def render_html(sweeps: Sequence[Sweep]) -> str:
    rows, cols, cells = build_matrix(sweeps)
    esc = html.escape

    def css(text: str) -> str:
        return "fail" if text.startswith("FAIL") else "pass" if text.startswith("pass") else "skip"

    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = []
    for row in rows:
        tds = []
        for c in cols:
            text = _summarize(cells.get((row, c), []))
            tds.append(f'<td class="{css(text)}">{esc(text)}</td>')
        body.append(f"<tr><th>{esc(row)}</th>{''.join(tds)}</tr>")
    return (
        "<!doctype html><meta charset='utf-8'><title>parity matrix</title>"
        "<style>td,th{border:1px solid #ccc;padding:4px;font:13px monospace}"
        ".pass{background:#dfd}.fail{background:#fcc}.skip{background:#eee}</style>"
        f"<table><tr><th>contract · dtype</th>{head}</tr>{''.join(body)}</table><p>{esc(LEGEND)}</p>"
    )
