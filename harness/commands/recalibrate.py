"""``parity recalibrate``: new thresholds or perf baselines from N gate results files.

Reads the results.json of several ``parity gate --report DIR`` runs, proposes new values with
:mod:`harness.recalibrate`'s policy, prints the diff and writes only with ``--write`` (atomically,
the old file kept as ``.bak``). A proposal that loosens a bound is refused (exit 2, with the list)
unless ``--allow-loosen``. Thresholds go to the base file, or with ``--platform NAME`` /
``--per-platform`` to overlays; perf values always per machine, grouped by the results' ``platform``
into ``platforms/perf/<platform>.json`` (a median over two machines is a machine that does not
exist). The rules: docs/references.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from harness.commands._options import (
    add_baselines,
    existing_baselines_dir,
    perf_profile,
    project,
    writable_baselines_dir,
)
from harness.errors import ConfigError
from harness.files.reading import is_present
from harness.report.console import make_console

HELP = "propose thresholds or perf baselines from N gate results (a diff table); --write writes them"
DESCRIPTION = """\
Propose new thresholds or perf baselines from the results.json of several passing `parity gate
--report DIR` runs (3 or more), show old -> new as a table, and write only with --write
(atomically, the previous file kept as .bak). A proposal that loosens a bound is refused unless
--allow-loosen; results of failed runs are refused unless --include-failed."""
EPILOG = """\
examples:
  parity recalibrate thresholds --results run1/results.json run2/results.json run3/results.json
  parity recalibrate thresholds --results run*/results.json --platform h200 --write
  parity recalibrate perf --results run*/results.json --write       # -> platforms/perf/<platform>.json

exit codes: 0 proposals shown (and written with --write); 2 a bad file or argument, a failed
run given without --include-failed, or a loosening refused (nothing is written then)."""


@dataclass
class Group:
    """The results that go into one file."""

    platform: str | None  # None: the base file
    paths: list[Path]
    docs: list[dict[str, Any]]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "recalibrate",
        help=HELP,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    _register_thresholds(what)
    _register_perf(what)


def _register_thresholds(what: argparse._SubParsersAction) -> None:
    thresholds = what.add_parser(
        "thresholds",
        help="clip/ssim/psnr/mean_abs_diff thresholds from the worst run",
        description="Thresholds from the worst value over the runs (policy in harness/recalibrate/policy.py).",
    )
    _common(thresholds)
    thresholds.add_argument(
        "--policy",
        type=Path,
        default=None,
        metavar="FILE",
        help="policy overrides, JSON or TOML (e.g. [psnr] margin = 2, cap = 35)",
    )
    where = thresholds.add_mutually_exclusive_group()
    where.add_argument(
        "--platform",
        default=None,
        metavar="NAME",
        help="write the overlay platforms/NAME.json instead of the base file",
    )
    where.add_argument("--per-platform", action="store_true", help="one overlay per 'platform' recorded in the results")
    thresholds.set_defaults(run=run_thresholds)


def _register_perf(what: argparse._SubParsersAction) -> None:
    perf = what.add_parser(
        "perf",
        help="perf baselines: median of the runs, changed only beyond tolerance/3",
        description="Perf baselines per machine: median of N runs, changed only when |Δ| > tolerance/3, "
        "4 significant figures.",
    )
    _common(perf)
    perf.add_argument(
        "--platform",
        default=None,
        metavar="NAME",
        help="write platforms/perf/NAME.json from all results (default: the 'platform' of each result)",
    )
    perf.add_argument(
        "--profile",
        default=None,
        metavar="P",
        help="tolerance profile whose tolerance/3 is the margin (default: the project file's, else pr_test)",
    )
    perf.set_defaults(run=run_perf)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--results", type=Path, nargs="+", required=True, metavar="FILE", help="results.json files of gate runs"
    )
    add_baselines(parser)
    parser.add_argument("--write", action="store_true", help="write the proposals (default: only show them)")
    parser.add_argument("--allow-loosen", action="store_true", help="allow proposals that loosen a bound")
    parser.add_argument(
        "--include-failed",
        action="store_true",
        help="use results of failed gate runs too (refused by default: they hold the values the gate rejected)",
    )


def _load(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The results files, refused when a run failed (unless --include-failed); warnings go to stderr."""
    from harness.recalibrate import check_runs
    from harness.results import load_results

    docs = [load_results(p) for p in args.results]
    err = make_console(stderr=True)
    for warning in check_runs(docs, args.results, args.include_failed):
        err.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    return docs


def _group(
    paths: Sequence[Path], docs: Sequence[dict[str, Any]], platform: str | None, per_platform: bool
) -> list[Group]:
    """Sort results into the files they belong to (see the module docstring)."""
    from harness.baselines.perf import platform_matches

    for path, doc in zip(paths, docs):
        if "platform" in doc:
            _check_platform(doc["platform"], path, "platform")
    if platform is not None:
        _check_platform(platform, None, "--platform")
        for path, doc in zip(paths, docs):
            recorded = doc.get("platform")
            if recorded is not None and not platform_matches(platform, recorded):
                raise ConfigError(
                    f"results are from platform {recorded!r}, not {platform!r}", path=path, key="platform"
                )
        return [Group(platform, list(paths), list(docs))]
    if not per_platform:
        return [Group(None, list(paths), list(docs))]
    groups: dict[str, Group] = {}
    for path, doc in zip(paths, docs):
        if "platform" not in doc:
            raise ConfigError(
                "missing key 'platform' (which machine these results are from): pass --platform NAME", path=path
            )
        groups.setdefault(doc["platform"], Group(doc["platform"], [], [])).paths.append(path)
        groups[doc["platform"]].docs.append(doc)
    return list(groups.values())


def _check_platform(name: str, path: Path | None, key: str) -> None:
    """A platform becomes a file name: it must be a normalised device name (``h200``, ``cpu_x86_64``)."""
    from harness.baselines.platforms import normalize_device_name

    if not name or normalize_device_name(name) != name:
        raise ConfigError(
            f"{name!r} is not a normalised platform name (lowercase letters, digits, '_'; "
            "e.g. h200, mi300x, cpu_x86_64)",
            path=path,
            key=key,
        )


def _table(header: Sequence[str], rows: Sequence[tuple[str, ...]]) -> Table:
    table = Table()
    for column in header:
        table.add_column(column, justify="right" if column in ("old", "worst", "median", "new", "spread") else "left")
    style = {"LOOSENS": "bold red", "tightens": "green", "added": "green", "unchanged": "dim"}
    for row in rows:
        *cells, change = row
        table.add_row(*map(escape, cells), f"[{style.get(change, '')}]{change}[/]")
    return table


def _report(title: str, header: Sequence[str], rows: Sequence[tuple[str, ...]], proposals: Sequence[Any]) -> None:
    out = make_console()
    out.print(escape(title), soft_wrap=True)
    out.print(_table(header, rows))
    changed = sum(p.changed for p in proposals)
    loosening = sum(p.loosens for p in proposals)
    out.print(f"{changed} of {len(proposals)} values change, {loosening} loosen")


def _finish(
    args: argparse.Namespace,
    plans: Sequence[tuple[Path, Any, Sequence[Any]]],
    write: Callable[[Path, Any, Sequence[Any]], None],
) -> int:
    """Refuse loosening for every file before writing any; then write each file atomically."""
    from harness.recalibrate import refuse_loosening

    out = make_console()
    every = [p for _, _, proposals in plans for p in proposals]
    if not args.write:
        loosening = sum(p.loosens for p in every)
        note = (
            f"; {loosening} would loosen: --write needs --allow-loosen" if loosening and not args.allow_loosen else ""
        )
        out.print(f"dry run: nothing written (pass --write){note}")
        return 0
    refuse_loosening(every, args.allow_loosen)  # for every file at once, before any is written
    for path, plan, proposals in plans:
        if not any(p.changed for p in proposals):
            out.print(f"{path}: unchanged, not rewritten")
            continue
        existed = path.exists()
        write(path, plan, proposals)
        out.print(f"wrote {path}" + (f" (previous kept as {path.name}.bak)" if existed else " (new file)"))
    return 0


# ------------------------------------------------------------------------------ thresholds


def run_thresholds(args: argparse.Namespace) -> int:
    from harness.baselines.thresholds import OVERLAYS_DIR, THRESHOLDS_FILE, ThresholdSet
    from harness.recalibrate import (
        DEFAULT_POLICY,
        PROPOSAL_HEADER,
        apply_proposals,
        load_policy,
        proposal_rows,
        propose_thresholds,
    )

    directory = writable_baselines_dir(args) if args.write else existing_baselines_dir(args)
    policy = load_policy(args.policy) if args.policy else DEFAULT_POLICY
    base = directory / THRESHOLDS_FILE
    groups = _group(args.results, _load(args), args.platform, args.per_platform)
    plans = []
    for group in groups:
        target = base if group.platform is None else directory / OVERLAYS_DIR / f"{group.platform}.json"
        chain = ThresholdSet.load(base, [target] if target != base and is_present(target) else [])
        proposals = propose_thresholds(chain, group.docs, policy, group.paths)
        title = f"thresholds -> {target}, from {len(group.docs)} results: {' '.join(map(str, group.paths))}"
        _report(title, PROPOSAL_HEADER, proposal_rows(proposals), proposals)
        plans.append((target, chain, proposals))

    def write(path: Path, chain: Any, proposals: Sequence[Any]) -> None:
        from harness.recalibrate import merge_into_overlay

        if path == base:
            apply_proposals(chain, proposals, allow_loosen=args.allow_loosen).save(path, backup=True)
        else:
            merge_into_overlay(path, proposals, allow_loosen=args.allow_loosen)

    return _finish(args, plans, write)


# ------------------------------------------------------------------------------------- perf


def run_perf(args: argparse.Namespace) -> int:
    from harness.baselines.perf import PerfBaselines, perf_overlay_path
    from harness.recalibrate import PERF_PROPOSAL_HEADER, perf_proposal_rows, propose_perf

    directory = writable_baselines_dir(args) if args.write else existing_baselines_dir(args)
    profile = perf_profile(args.profile, args) or "pr_test"
    docs = _load(args)
    groups = _group(args.results, docs, args.platform, per_platform=True)
    if not any(doc.get("perf") for doc in docs):
        from harness.gate.perf import how_to_create
        from harness.project import carried_options

        carried = carried_options(project(args), baselines=directory)
        raise ConfigError(
            f"the results hold no timings (the perf stage did not run); "
            f"{how_to_create(str(groups[0].platform), carried, carried)}",
            key="--results",
        )
    plans = []
    for group in groups:
        assert group.platform is not None  # per_platform grouping always names one
        chain = PerfBaselines.for_platform(directory, group.platform)
        proposals = propose_perf(chain, group.docs, chain.tolerances(profile))
        target = perf_overlay_path(directory, group.platform)
        title = f"perf (margin: {profile} tolerance/3) -> {target}, from {len(group.docs)} results: {' '.join(map(str, group.paths))}"
        _report(title, PERF_PROPOSAL_HEADER, perf_proposal_rows(proposals), proposals)
        plans.append((target, (chain, group), proposals))

    if args.write:
        from harness.recalibrate import refuse_inside_noise

        refuse_inside_noise(
            p for _, _, proposals in plans for p in proposals
        )  # every file at once, before any is written

    def write(path: Path, plan: tuple[Any, Group], proposals: Sequence[Any]) -> None:
        from harness.recalibrate import merge_into_perf_overlay

        chain, group = plan
        hardware = sorted({str(doc["device_name"]) for doc in group.docs if "device_name" in doc})
        merge_into_perf_overlay(path, chain, proposals, str(group.platform), hardware, args.allow_loosen)

    return _finish(args, plans, write)
