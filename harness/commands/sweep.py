"""parity sweep: contracts over backend × dtype × world size on this machine, into one JSON file."""

from __future__ import annotations

import argparse

from harness.commands._options import (
    add_cases,
    add_json,
    add_target,
    cases_root,
    check_backends,
    run_options,
    world_size,
)
from harness.errors import ConfigError

HELP = "run contracts over a backend × dtype × world-size matrix on this machine and write a sweep JSON"
EPILOG = """\
Backends are names (torch_sdpa, math, fa, sage_attn) or torch_sdpa:KERNEL (flash, efficient,
cudnn, math) to pin an SDPA kernel; the default is every backend, plus every SDPA kernel on
CUDA. Unavailable backends become skipped cells with the reason. Set PARITY_PLATFORM (e.g.
rocm:gfx950) to run the platform branches simulated; the file and the matrix say so.
Without --json FILE the sweep prints its matrix and keeps nothing; merge the files of several
machines with `parity matrix`."""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "sweep", help=HELP, description=HELP, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target(parser)
    parser.add_argument("--backends", nargs="+", default=None, metavar="B", help="backend columns (default: all)")
    parser.add_argument(
        "--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], metavar="D", help="dtypes (default: fp32 bf16 fp16)"
    )
    parser.add_argument(
        "--world-sizes", nargs="+", type=world_size, default=None, metavar="N", help="only cases at these world sizes"
    )
    parser.add_argument(
        "--contracts",
        nargs="+",
        default=None,
        metavar="ID",
        help="only these contracts (default: every contract with a backend and a dtype)",
    )
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel timings")
    add_json(parser, "the sweep (every cell, kernel times; what `parity matrix` merges)")
    add_cases(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.contracts.params import canonical_dtype
    from harness.gate.contracts import load_contract_cases
    from harness.report.console import make_console, progress
    from harness.report.output import emit_json, human_console
    from harness.results import EXIT_CODES, CaseResult, summary_line, verdict
    from harness.sweep import BackendColumn, SweepOptions, expand_matrix, run_sweep
    from harness.sweep.matrix import parse_sweep, render_markdown

    run = run_options(args)
    run.usable()  # the device first, then the target
    cases = load_contract_cases(cases_root(args), run)
    if args.contracts:
        unknown = sorted(set(args.contracts) - {c.contract_id for c in cases})
        if unknown:
            raise ConfigError(f"no case of contract(s) {', '.join(unknown)}", key="--contracts")
        cases = [c for c in cases if c.contract_id in args.contracts]
    try:
        dtypes = tuple(canonical_dtype(d) for d in args.dtypes)
    except ValueError as exc:
        raise ConfigError(str(exc), key="--dtypes") from None
    backends = tuple(BackendColumn.parse(b) for b in args.backends or ())
    check_backends(
        run, [(b.backend, b.kernel) for b in backends], {"backend": "--backends", "sdpa_kernel": "--backends"}
    )
    options = SweepOptions(run, backends, dtypes, tuple(args.world_sizes or ()), not args.no_kernels)
    total = len(expand_matrix(cases, options.columns(), dtypes, options.world_sizes))
    if total == 0:
        raise ConfigError("the selection gives an empty matrix", key="--contracts/--world-sizes")
    err = make_console(stderr=True)
    results: list[CaseResult] = []
    with progress(err, total, "sweep") as advance:

        def on_result(result: CaseResult) -> None:
            results.append(result)
            advance(result)

        document = run_sweep(cases, options, on_result=on_result)
    out = human_console(args.json)
    if args.json is None:
        out.print(render_markdown([parse_sweep(document)]), markup=False, soft_wrap=True)
    else:
        emit_json(args.json, document)
    where = "" if args.json in (None, "-") else f"; wrote {args.json}"
    out.print(f"{summary_line(results)}; platform {document['platform']['label']}{where}")
    return EXIT_CODES[verdict(results)]
