"""parity bless: new reference images for named image cases, shown old -> new, written as one set."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from harness.commands._options import (
    add_baselines,
    add_cases,
    add_device,
    add_json,
    add_pipeline_target,
    baselines_dir,
    cases_root,
    device,
    existing_baselines_dir,
    pipeline_target,
    project,
    seconds,
    writable_baselines_dir,
)
from harness.errors import ConfigError
from harness.project.hints import command

HELP = "write new reference images for named image cases (old -> new table; --dry-run; --from-results DIR)"
DESCRIPTION = """\
Write new reference images for the named image cases (or every case with --all): each case's
fields run on one rank, or, with --from-results DIR, the candidates that `parity gate --report
DIR` saved (failing cases always, every case with --keep-outputs). A table shows old -> new for
every case (hash, PSNR between old and new, which fields changed) before anything is written;
--dry-run stops there. All references and the manifest switch over as one set: a kill at any
moment leaves the old set or the new one."""
EPILOG = """\
examples:
  parity bless zimage_t2i_1rank --dry-run        # what would change
  parity gate --report out; parity bless --from-results out zimage_t2i_1rank   # promote what the gate made"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bless", help=HELP, description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("ids", nargs="*", metavar="CASE", help="image case ids to bless")
    parser.add_argument(
        "--all", action="store_true", help="every image case (with --from-results: every saved candidate)"
    )
    parser.add_argument(
        "--from-results",
        type=Path,
        default=None,
        metavar="DIR",
        help="promote the candidates a gate run saved in DIR (its --report directory) instead of running",
    )
    parser.add_argument("--dry-run", action="store_true", help="show the table, write nothing")
    add_cases(parser)
    add_baselines(parser)
    add_device(parser)
    add_pipeline_target(parser, "to bless from")
    parser.add_argument(
        "--timeout", type=seconds, default=300.0, metavar="S", help="per-case timeout in seconds (default: 300)"
    )
    add_json(parser, "the old -> new table")
    parser.set_defaults(run=run)


def _ids(args: argparse.Namespace) -> list[str]:
    """The cases asked for; never every case by default."""
    from harness.gate.bless import failed_cases, saved_candidates

    if args.ids and args.all:
        raise ConfigError("name cases or pass --all, not both", key="--all")
    if args.from_results is not None:
        saved = saved_candidates(args.from_results, carried(args))
        if args.all:
            return saved
        if not args.ids:
            failed = [c for c in failed_cases(args.from_results) if c in saved]
            example = command(["bless", "--from-results", str(args.from_results), *(failed or saved)], carried(args))
            raise ConfigError(f"name the cases to bless (`{example}`) or pass --all; nothing was written", key="CASE")
    elif not args.ids and not args.all:
        raise ConfigError(
            "name the image cases to bless, or pass --all to bless every one; nothing was written", key="CASE"
        )
    return list(args.ids)


def carried(args: argparse.Namespace) -> list[str]:
    """The options of this bless that a printed bless command must repeat."""
    from harness.project import carried_options

    return carried_options(
        project(args),
        cases=cases_root(args),
        baselines=baselines_dir(args),
        pipeline=pipeline_target(args),
        device=device(args),
    )


def run(args: argparse.Namespace) -> int:
    from harness.baselines.image_writes import write_set
    from harness.baselines.images import MANIFEST, REFERENCES_DIR
    from harness.cases.image import check_pipeline_args_used, load_image_cases, select_image_cases
    from harness.gate.bless import CHANGE_HEADERS, blessings_for, changes
    from harness.report.console import make_console, text_table
    from harness.report.output import emit_json, human_console
    from harness.targets.base import PipelineFailed

    baselines = existing_baselines_dir(args) if args.dry_run else writable_baselines_dir(args)
    ids = _ids(args)
    cases = select_image_cases(load_image_cases(cases_root(args), pipeline_target(args)), ids)
    check_pipeline_args_used(cases, pipeline_target(args))
    out = human_console(args.json)
    start = time.perf_counter()
    directory = baselines / REFERENCES_DIR
    try:
        blessings = blessings_for(cases, device(args), args.timeout, args.from_results, carried(args))
    except PipelineFailed as exc:  # an external command failed: nothing was written
        make_console(stderr=True).print(f"parity bless: {exc.reason}\n{exc.detail}", markup=False, highlight=False)
        return 1
    whole_set = bool(args.all)  # every case blessed: a manifest of an older format is replaced
    rows = changes(directory, blessings, whole_set)
    out.print(
        text_table(
            f"bless -> {directory}",
            CHANGE_HEADERS,
            (c.cells() for c in rows),
            no_wrap=("case", "old sha256", "new sha256"),
        )
    )
    if args.json is not None:
        emit_json(
            args.json, {"dry_run": args.dry_run, "directory": str(directory), "changes": [c.to_json() for c in rows]}
        )
    if args.dry_run:
        out.print(f"dry run: nothing written ({len(rows)} case(s) would be blessed)")
        return 0
    write_set(directory, blessings, whole_set)
    counts = {k: sum(c.kind == k for c in rows) for k in ("new", "changed", "unchanged", "repaired")}
    out.print(
        f"{len(rows)} reference(s) written as one set with {directory / MANIFEST} ({counts['new']} new, "
        f"{counts['changed']} changed, {counts['unchanged']} unchanged, {counts['repaired']} repaired) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0
