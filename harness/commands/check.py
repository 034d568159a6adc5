"""parity check: run contract cases on a target; a progress bar, then a result table with figures."""

from __future__ import annotations

import argparse

from harness.commands._options import (
    add_cases,
    add_outputs,
    add_tables,
    add_target,
    cases_root,
    check_backends,
    project,
    run_options,
    world_size,
)

HELP = "run contract cases on a target and print the results"
EPILOG = """\
IDs select cases by contract id (usp.ring_parity), case id (sglang_suffix_w2), the id of a
matrix case without its [axes] (ulysses), or a glob (usp.replicated_*). --world-size keeps the
cases of that world size; --backend, --dtype and --sdpa-kernel override the cases' values
(re-validated); --deterministic runs every case under torch.use_deterministic_algorithms(True).
A backend's own limits (flash-attn: fp16/bf16 only, no mask) are pinned in
contracts/backends/<backend>.toml of the case directory.
Each world size runs in one persistent rank pool."""


def _dtype(text: str) -> str:
    from harness.contracts.params import canonical_dtype

    try:
        return canonical_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction) -> None:
    from harness.contracts.params import SDPA_KERNELS

    parser = sub.add_parser(
        "check", help=HELP, description=HELP, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("ids", nargs="*", metavar="ID", help="contracts or cases to run (default: every case)")
    add_cases(parser)
    add_target(parser)
    parser.add_argument(
        "--world-size", type=world_size, default=None, metavar="N", help="only the cases at this world size"
    )
    parser.add_argument("--backend", default=None, metavar="B", help="override the backend of every case")
    parser.add_argument(
        "--dtype", type=_dtype, default=None, metavar="D", help="override the dtype of every case (fp32, bf16, fp16)"
    )
    parser.add_argument(
        "--sdpa-kernel", default=None, choices=SDPA_KERNELS, help="pin torch SDPA to one kernel in every case"
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="set every case's `deterministic` (the target's calls and backward under torch's deterministic "
        "algorithms; flash-attn then runs its deterministic backward)",
    )
    add_outputs(parser)
    add_tables(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.cases.contract import CaseSelection, select_cases
    from harness.gate.check import CheckOutputs, run_check
    from harness.gate.contracts import load_contract_cases
    from harness.report.output import check_outputs

    options = run_options(args)
    options.usable()
    check_backends(
        options, [(args.backend, args.sdpa_kernel)], {"backend": "--backend", "sdpa_kernel": "--sdpa-kernel"}
    )
    check_outputs((args.junit, "--junit"))  # --json: checked for every verb (cli.main)
    selection = CaseSelection(
        tuple(args.ids), args.world_size, args.backend, args.dtype, args.sdpa_kernel, args.deterministic
    )
    root = cases_root(args)
    cases = select_cases(load_contract_cases(root, options), selection, root)
    used = project(args)
    return run_check(cases, options, CheckOutputs(args.json, args.junit, args.tables, used.file if used else None))
