"""``parity bless``: re-run image cases on one rank and rewrite their reference images and the manifest."""

from __future__ import annotations

import argparse
import time

from harness.commands._options import add_baselines, add_cases, add_device, baselines_dir, cases_root, seconds

HELP = "re-run image cases on one rank and rewrite their reference images and manifest (only when asked)"
DESCRIPTION = ("Re-run image cases on one rank and rewrite their reference images and the SHA-256 manifest: the only "
               "writer of references. All cases run before anything is written.")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bless", help=HELP, description=DESCRIPTION)
    parser.add_argument("ids", nargs="*", metavar="CASE", help="image case ids to bless (default: every image case)")
    add_cases(parser)
    add_baselines(parser)
    add_device(parser)
    parser.add_argument("--pipeline-target", default="reference", metavar="P", help="pipeline to bless from (default: reference)")
    parser.add_argument("--timeout", type=seconds, default=300.0, metavar="S", help="per-case timeout in seconds (default: 300)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.baselines.images import MANIFEST, REFERENCES_DIR
    from harness.cases.image import load_image_cases, select_image_cases
    from harness.errors import ConfigError
    from harness.gate.bless import bless_cases
    from harness.gate.contracts import check_device
    from harness.ranks import PoolSet
    from harness.report.console import make_console
    from harness.targets.loader import load_pipeline_target

    baselines = baselines_dir(args)
    if not baselines.is_dir():
        raise ConfigError("no such baselines directory", path=baselines, key="--baselines")
    check_device(args.device)
    cases = select_image_cases(load_image_cases(cases_root(args), load_pipeline_target(args.pipeline_target)), args.ids)
    out = make_console()
    start = time.perf_counter()
    directory = baselines / REFERENCES_DIR
    with PoolSet(args.device) as pools:
        written = bless_cases(cases, directory, pools, args.pipeline_target, args.timeout)
    for case_id, (shape, files) in written.items():
        out.print(f"blessed {case_id} ({'x'.join(map(str, shape))}): {', '.join(str(directory / f) for f in files)}")
    out.print(f"{len(cases)} reference(s) written with their hashes to {directory / MANIFEST} "
              f"in {time.perf_counter() - start:.1f} s")
    return 0
