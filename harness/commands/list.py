"""parity list: the contracts (with parameters and requirements), the contract cases, the image cases, the perf scenarios and the targets."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from harness.commands._options import add_baselines, add_cases, add_json, add_pipeline_target, baselines_dir, cases_root, pipeline_target
from harness.report.output import emit_json, human_console

HELP = "list the contracts, the contract cases, the image cases, the perf scenarios and the targets"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("list", help=HELP, description=HELP)
    add_cases(parser)
    add_baselines(parser)
    add_pipeline_target(parser, "that reads the image cases")
    add_json(parser, "the lists (instead of the tables)")
    parser.set_defaults(run=run)


def perf_scenarios(baselines: Path) -> list[dict[str, Any]]:
    """Every perf scenario of the base file and of each machine's overlay, with the platform it belongs to."""
    from harness.baselines.perf import PERF_BASE_FILE, PERF_OVERLAY_DIR, PerfBaselines

    files = [baselines / PERF_BASE_FILE] if (baselines / PERF_BASE_FILE).is_file() else []
    files += sorted((baselines / PERF_OVERLAY_DIR).glob("*.json"))
    out = []
    for path in files:
        doc = PerfBaselines.load(path).to_json()
        platform = path.stem if path.parent.name == PERF_OVERLAY_DIR.name else doc.get("metadata", {}).get("platform")
        for scenario_id, scenario in doc.get("scenarios", {}).items():
            out.append({"id": scenario_id, "platform": platform, "expected_e2e_ms": scenario.get("expected_e2e_ms"),
                        "file": str(path)})
    return out


def inventory(args: argparse.Namespace) -> dict[str, Any]:
    from harness.cases.contract import load_cases
    from harness.cases.image import image_case_dir, is_image_only, load_image_cases
    from harness.contracts import all_contracts
    from harness.targets.loader import BUILTIN_PIPELINES, BUILTIN_TARGETS, load_pipeline_target, load_target

    contracts = [
        {
            "id": c.id,
            "description": c.description,
            "requires": sorted(c.requires),
            "min_world_size": c.min_world_size,
            "params": [{"name": p.name, "kind": p.kind, "doc": p.doc} for p in c.params],
        }
        for c in all_contracts()
    ]
    cases = [
        {"id": c.id, "contract": c.contract_id, "world_size": c.world_size, "file": c.source, "params": dict(c.params)}
        for c in (load_cases(cases_root(args)) if not is_image_only(cases_root(args)) else [])
    ]
    image_cases = [
        {"id": c.id, "kind": c.kind, "world_size": c.world_size, "file": c.source, "target": c.target, "fields": dict(c.fields)}
        for c in (load_image_cases(cases_root(args), *pipeline_target(args))
                  if image_case_dir(cases_root(args)).is_dir() else [])
    ]
    targets = []
    for name, (_, _, description) in BUILTIN_TARGETS.items():
        target = load_target(name)
        targets.append({
            "name": name,
            "description": description,
            "capabilities": sorted(target.capabilities()),
            "unavailable_on_cpu": target.unavailable_reason("cpu"),
        })
    pipelines = [{"name": name, "description": description, "unavailable_on_cpu": load_pipeline_target(name).unavailable_reason("cpu")}
                 for name, (_, _, description) in BUILTIN_PIPELINES.items()]
    return {"contracts": contracts, "cases": cases, "image_cases": image_cases,
            "perf_scenarios": perf_scenarios(baselines_dir(args)), "targets": targets, "pipeline_targets": pipelines}


def run(args: argparse.Namespace) -> int:
    data = inventory(args)
    if args.json is not None:
        emit_json(args.json, data)
        return 0
    console = human_console(None)
    table = Table(title="contracts")
    for column in ("id", "requires", "description"):
        table.add_column(column, overflow="fold")
    for c in data["contracts"]:
        table.add_row(c["id"], ", ".join(c["requires"]), escape(c["description"]))
    console.print(table)
    console.print(_table(f"contract cases ({len(data['cases'])})", ("id", "contract", "W", "file"),
                         [(c["id"], c["contract"], str(c["world_size"]), c["file"]) for c in data["cases"]]))
    console.print(_table(f"image cases ({len(data['image_cases'])})", ("id", "kind", "W", "file"),
                         [(c["id"], c["kind"], str(c["world_size"]), c["file"]) for c in data["image_cases"]]))
    console.print(_table(f"perf scenarios ({len(data['perf_scenarios'])}; the gate times a machine's own)",
                         ("id", "platform", "e2e ms", "file"),
                         [(p["id"], str(p["platform"]), f"{p['expected_e2e_ms']:.4g}", p["file"]) for p in data["perf_scenarios"]]))
    table = Table(title="targets (or --target module:factory)")
    for column in ("name", "capabilities", "on cpu", "description"):
        table.add_column(column, overflow="fold")
    for t in data["targets"]:
        table.add_row(t["name"], ", ".join(t["capabilities"]), escape(t["unavailable_on_cpu"] or "available"), escape(t["description"]))
    console.print(table)
    console.print(_table("pipeline targets of the image cases (or --pipeline-target module:factory)", ("name", "on cpu", "description"),
                         [(p["name"], p["unavailable_on_cpu"] or "available", p["description"]) for p in data["pipeline_targets"]]))
    return 0


def _table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    """A listing: the first column (ids) never wraps."""
    table = Table(title=escape(title))
    for column in columns:
        table.add_column(column, no_wrap=column == columns[0], overflow="fold")
    for row in rows:
        table.add_row(*map(escape, row))
    return table
