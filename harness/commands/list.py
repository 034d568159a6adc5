"""``parity list``: the contracts (with parameters and requirements), the contract cases and the targets."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.markup import escape
from rich.table import Table

from harness.commands._options import add_cases, cases_root
from harness.report.console import make_console

HELP = "list the contracts, the contract cases and the targets"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("list", help=HELP, description=HELP)
    add_cases(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(run=run)


def inventory(args: argparse.Namespace) -> dict[str, Any]:
    from harness.cases.contract import load_cases
    from harness.contracts import all_contracts
    from harness.targets.loader import BUILTIN_TARGETS, load_target

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
        for c in load_cases(cases_root(args))
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
    return {"contracts": contracts, "cases": cases, "targets": targets}


def run(args: argparse.Namespace) -> int:
    data = inventory(args)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    console = make_console()
    table = Table(title="contracts")
    for column in ("id", "requires", "description"):
        table.add_column(column, overflow="fold")
    for c in data["contracts"]:
        table.add_row(c["id"], ", ".join(c["requires"]), escape(c["description"]))
    console.print(table)
    table = Table(title=f"contract cases ({len(data['cases'])})")
    for column in ("id", "contract", "W", "file"):
        table.add_column(column, overflow="fold")
    for c in data["cases"]:
        table.add_row(escape(c["id"]), c["contract"], str(c["world_size"]), escape(c["file"]))
    console.print(table)
    table = Table(title="targets (or --target module:factory)")
    for column in ("name", "capabilities", "on cpu", "description"):
        table.add_column(column, overflow="fold")
    for t in data["targets"]:
        table.add_row(t["name"], ", ".join(t["capabilities"]), escape(t["unavailable_on_cpu"] or "available"), escape(t["description"]))
    console.print(table)
    return 0
