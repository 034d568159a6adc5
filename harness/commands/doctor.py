"""parity doctor: what this machine can run, and why not where it cannot."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from harness.commands._options import add_json, project
from harness.project import Project
from harness.report.console import make_console
from harness.report.output import emit_json

HELP = (
    "show Python/torch versions, the platform, devices, every attention backend and target, and why one is unavailable"
)
_PACKAGES = (
    "torch",
    "flash-attn",
    "flash-attn-4",
    "flash_attn_3",
    "sageattention",
    "yunchang",
    "transformers",
    "scikit-image",
    "rich",
)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("doctor", help=HELP, description=HELP)
    add_json(parser, "the diagnosis (instead of the tables)")
    parser.set_defaults(run=run)


def _devices(cuda: bool) -> list[dict[str, Any]]:
    import torch

    devices = [{"type": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count()}]
    count = torch.cuda.device_count() if cuda else 0
    return devices + [{"type": "cuda", "index": i, "name": torch.cuda.get_device_name(i)} for i in range(count)]


def _targets(device: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every built-in attention and pipeline target: whether it can run on ``device``, and why not."""
    from harness.targets.loader import BUILTIN_PIPELINES, BUILTIN_TARGETS, load_pipeline_target, load_target
    from harness.targets.spec import TargetSpec

    why = {name: load_target(TargetSpec(name)).unavailable_reason(device) for name in BUILTIN_TARGETS}
    pipelines = {name: load_pipeline_target(TargetSpec(name)).unavailable_reason(device) for name in BUILTIN_PIPELINES}
    return (
        [{"name": n, "available": r is None, "reason": r, "device": device} for n, r in why.items()],
        [{"name": n, "reason": r, "device": device, "available": r is None} for n, r in pipelines.items()],
    )


def _project(project: Project | None) -> dict[str, Any] | None:
    if project is None:
        return None
    return {
        "file": str(project.file),
        "cases": _text(project.cases),
        "baselines": _text(project.baselines),
        "target": project.target,
        "target_args": dict(project.target_args),
        "pipeline_target": project.pipeline_target,
        "pipeline_target_args": dict(project.pipeline_target_args),
        "device": project.device,
        "profile": project.profile,
    }


def diagnose(project: Project | None = None) -> dict[str, Any]:
    """Everything ``doctor`` shows; ``project`` is the project file in effect (its cases and baselines are the ones used)."""
    import torch

    from harness.baselines.platforms import machine_record
    from harness.paths import HOME_ENV, default_baselines_dir, default_cases_dir, parity_home
    from harness.targets.base import distribution_version
    from harness.targets.reference.attention import backend_report
    from reference_impl.platform import PLATFORM_ENV

    machine = machine_record()
    cuda = torch.cuda.is_available()
    targets, pipelines = _targets("cuda" if cuda else "cpu")
    return {
        **{k: machine[k] for k in ("python", "torch", "torch_cuda", "torch_hip")},
        "platform": {k: machine[k] for k in ("kind", "label", "simulated", "gcn_arch", "device_name")},
        "platform_env": {PLATFORM_ENV: os.environ.get(PLATFORM_ENV)},
        "devices": _devices(cuda),
        "backends": backend_report(),
        "targets": targets,
        "pipeline_targets": pipelines,
        "packages": {p: distribution_version(p) for p in _PACKAGES},
        "project": _project(project),
        "paths": {
            HOME_ENV: os.environ.get(HOME_ENV),
            "home": str(parity_home()),
            "cases": str((project and project.cases) or default_cases_dir()),
            "baselines": str((project and project.baselines) or default_baselines_dir()),
        },
    }


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


def run(args: argparse.Namespace) -> int:
    data = diagnose(project(args))
    if args.json is not None:
        emit_json(args.json, data)
        return 0
    console = make_console()
    p = data["platform"]
    console.print(
        f"python {data['python']}, torch {data['torch']} (cuda {data['torch_cuda']}, hip {data['torch_hip']})"
    )
    console.print(
        f"platform {escape(p['label'])} on {escape(p['device_name'])}"
        + (" [yellow](forced by PARITY_PLATFORM)[/]" if p["simulated"] else "")
    )
    for d in data["devices"]:
        console.print(escape(f"device {d['type']}{':' + str(d['index']) if 'index' in d else ''} {d['name']}"))
    table = Table(title="attention backends")
    for column in ("backend", "available", "returns LSE (ring)", "implementation", "reason"):
        table.add_column(column, overflow="fold")
    for b in data["backends"]:
        table.add_row(
            b["name"],
            "[green]yes[/]" if b["available"] else "[red]no[/]",
            "yes" if b["returns_lse"] else "no",
            escape(b["implementation"] or ""),
            escape(b["reason"] or ""),
        )
    console.print(table)
    device = data["targets"][0]["device"]
    console.print(_availability(f"targets on {device}", "target", data["targets"]))
    console.print(
        _availability(f"pipeline targets on {device} (at one rank)", "pipeline target", data["pipeline_targets"])
    )
    console.print(escape("packages: " + ", ".join(f"{k} {v or '-'}" for k, v in data["packages"].items())))
    used = data["project"]
    console.print(
        escape(
            f"project file {used['file']}"
            if used
            else "project file: none (no parity.toml or [tool.parity] from here upwards; `parity init` writes one)"
        )
    )
    console.print(escape(f"cases {data['paths']['cases']}, baselines {data['paths']['baselines']}"))
    return 0


def _availability(title: str, kind: str, entries: list[dict[str, Any]]) -> Table:
    """One row per target: whether it can run here, and why not."""
    table = Table(title=title)
    for column in (kind, "available", "reason"):
        table.add_column(column, overflow="fold")
    for t in entries:
        table.add_row(t["name"], "[green]yes[/]" if t["available"] else "[red]no[/]", escape(t["reason"] or ""))
    return table
