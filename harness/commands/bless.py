"""``parity bless``: re-run image cases on one rank and rewrite their reference images and the manifest.

The only writer of reference images. Every case is run first (the single-rank output of its
pipeline config, see :mod:`harness.image_cases`); only when all runs succeeded are the PNGs
written, each atomically, and the manifest of SHA-256 hashes last, so an interrupted bless
leaves either the old references or a hash mismatch that the gate refuses, never a silent pass.
"""

from __future__ import annotations

import argparse
import time

from harness.commands._options import add_baselines, add_cases

HELP = "re-run image cases on one rank and rewrite their reference images and manifest (only when asked)"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bless", help=HELP, description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", metavar="CASE", help="image case ids to bless (default: every image case)")
    add_cases(parser)
    add_baselines(parser)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="device of the rank (default: cpu)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S", help="per-case timeout (default: 300)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.baselines.images import bless
    from harness.commands.check import check_device
    from harness.console import make_console
    from harness.errors import ConfigError
    from harness.image_cases import load_image_cases, run_image_case, select_image_cases
    from harness.paths import default_baselines_dir, default_cases_dir
    from harness.runner import PoolSet
    from harness.stages.images import REFERENCES_DIR

    baselines = args.baselines or default_baselines_dir()
    if not baselines.is_dir():
        raise ConfigError("no such baselines directory", path=baselines, key="--baselines")
    check_device(args.device)
    cases = select_image_cases(load_image_cases(args.cases or default_cases_dir()), args.ids)
    out = make_console()
    start = time.perf_counter()
    outputs = {}
    with PoolSet(args.device) as pools:
        pools.prestart([1])
        by_config = {}  # cases sharing a pipeline config (1-rank and N-rank of one prompt) share one run
        for case in cases:
            config = case.config(args.device)
            if config not in by_config:
                by_config[config] = run_image_case(case.reference_case(), pools, args.device, args.timeout).output
            outputs[case.id] = by_config[config]
    directory = baselines / REFERENCES_DIR
    for case in cases:
        files = bless(directory, case.id, outputs[case.id])
        shape = "x".join(map(str, outputs[case.id].shape))
        out.print(f"blessed {case.id} ({shape}): {', '.join(str(directory / f) for f in files)}")
    out.print(f"{len(cases)} reference(s) written with their hashes to {directory / 'manifest.json'} "
              f"in {time.perf_counter() - start:.1f} s")
    return 0
