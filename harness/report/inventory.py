"""``parity list`` as tables: contracts, contract cases, image cases, perf scenarios, targets, pipeline targets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    """A listing: the first column (ids) never wraps."""
    table = Table(title=escape(title))
    for column in columns:
        table.add_column(column, no_wrap=column == columns[0], overflow="fold")
    for row in rows:
        table.add_row(*map(escape, row))
    return table


def _folded(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    """A listing whose every column folds (long requirement and capability lists)."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def print_inventory(console: Console, data: Mapping[str, Any]) -> None:
    """Every list of :func:`harness.commands.list.inventory`, a table each."""
    contracts = [(c["id"], ", ".join(c["requires"]), escape(c["description"])) for c in data["contracts"]]
    console.print(_folded("contracts", ("id", "requires", "description"), contracts))
    cases = [(c["id"], c["contract"], str(c["world_size"]), c["file"]) for c in data["cases"]]
    console.print(_table(f"contract cases ({len(cases)})", ("id", "contract", "W", "file"), cases))
    images = [(c["id"], c["kind"], str(c["world_size"]), c["file"]) for c in data["image_cases"]]
    console.print(_table(f"image cases ({len(images)})", ("id", "kind", "W", "file"), images))
    scenarios = [
        (p["id"], str(p["platform"]), f"{p['expected_e2e_ms']:.4g}", p["file"]) for p in data["perf_scenarios"]
    ]
    title = f"perf scenarios ({len(scenarios)}; the gate times a machine's own)"
    console.print(_table(title, ("id", "platform", "e2e ms", "file"), scenarios))
    targets = [
        (
            t["name"],
            ", ".join(t["capabilities"]),
            escape(t["unavailable_on_cpu"] or "available"),
            escape(t["description"]),
        )
        for t in data["targets"]
    ]
    title = "targets (or --target module:factory)"
    console.print(_folded(title, ("name", "capabilities", "on cpu", "description"), targets))
    pipelines = [
        (p["name"], p["unavailable_on_cpu"] or "available", p["description"]) for p in data["pipeline_targets"]
    ]
    title = "pipeline targets of the image cases (or --pipeline-target module:factory)"
    console.print(_table(title, ("name", "on cpu", "description"), pipelines))
