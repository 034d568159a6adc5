"""Merge sweep files from several machines into one matrix (markdown or HTML).

Rows are contract × dtype; columns are platform × backend (the SDPA kernel when pinned).
A cell reads ``pass``/``FAIL``/``skip`` with its figure: ``=`` for bitwise, else the max abs
error. Platforms forced through PARITY_PLATFORM are labelled *simulated*.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import ConfigError

SWEEP_SCHEMA = "parity.sweep/1"


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


def load_sweep(path: str | Path) -> Sweep:
    """Read and validate a sweep file; errors name the file and the key."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("sweep file not found", path=path) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON (line {exc.lineno}): {exc.msg}", path=path) from None
    return parse_sweep(data, path)


def parse_sweep(data: Any, path: str | Path = "<this run>") -> Sweep:
    """Validate a sweep document (read from a file, or just made by ``parity sweep``)."""
    if not isinstance(data, dict) or data.get("schema") != SWEEP_SCHEMA:
        raise ConfigError(f"not a parity sweep file (expected schema {SWEEP_SCHEMA!r})", path=path, key="schema")
    for key, kind in (("platform", dict), ("cells", list)):
        if not isinstance(data.get(key), kind):
            raise ConfigError(f"must be a {kind.__name__}", path=path, key=key)
    for i, cell in enumerate(data["cells"]):
        for key in ("contract", "dtype", "backend", "status"):
            if not isinstance(cell, dict) or not isinstance(cell.get(key), str):
                raise ConfigError("missing or not a string", path=path, key=f"cells[{i}].{key}")
    extras = {k: v for k, v in data.items() if k not in ("schema", "platform", "cells", "kernels")}
    return Sweep(str(path), data["platform"], data["cells"], data.get("kernels", []), extras)


def _column(sweep: Sweep, cell: dict) -> str:
    backend = cell["backend"] + (f":{cell['kernel']}" if cell.get("kernel") else "")
    return f"{sweep.platform_label} | {backend}"


def _cell_text(cell: dict) -> str:
    status = cell["status"]
    figures = cell.get("figures") or {}
    if status == "skipped":
        return "skip"
    word = "pass" if status == "passed" else "FAIL"
    if figures.get("bitwise"):
        return f"{word} ="
    if figures.get("max_abs") is not None:
        return f"{word} {figures['max_abs']:.2e}"
    return word


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
    return _cell_text(worst) + (f" (+{len(slot) - 1})" if len(slot) > 1 else "")


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
