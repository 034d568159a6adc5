"""``parity check``: run contract cases on a target; a progress bar, then a verdict table with figures."""

from __future__ import annotations

import argparse
import fnmatch
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from harness.runner import PoolSet

from harness.cases import Case, load_cases, platform_of_device, with_overrides
from harness.commands._options import add_cases, add_outputs, add_target
from harness.console import make_console, progress, summary_line, verdict_table
from harness.contracts.params import canonical_dtype
from harness.contracts.verdict import FAILED, PASSED, SKIPPED, Verdict
from harness.errors import ConfigError
from harness.paths import default_cases_dir
from reference_impl.attention.backends import SDPA_KERNELS

HELP = "run contract cases on a target and print the verdicts"
EPILOG = """\
IDs select cases by contract id (usp.ring_parity), case id (sglang_suffix_w2), the id of a
matrix case without its [axes] (ulysses), or a glob (usp.replicated_*). --world-size keeps the
cases of that world size; --backend, --dtype and --sdpa-kernel override the cases' values
(re-validated).
Each world size runs in one persistent rank pool."""


def _dtype(text: str) -> str:
    try:
        return canonical_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("check", help=HELP, description=HELP, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ids", nargs="*", metavar="ID", help="contracts or cases to run (default: every case)")
    add_cases(parser)
    add_target(parser)
    parser.add_argument("--world-size", type=int, default=None, metavar="N", help="only the cases at this world size")
    parser.add_argument("--backend", default=None, metavar="B", help="override the backend of every case")
    parser.add_argument("--dtype", type=_dtype, default=None, metavar="D", help="override the dtype of every case (fp32, bf16, fp16)")
    parser.add_argument("--sdpa-kernel", default=None, choices=SDPA_KERNELS, help="pin torch SDPA to one kernel in every case")
    add_outputs(parser)
    parser.set_defaults(run=run)


def _matches(case: Case, pattern: str) -> bool:
    if pattern in (case.id, case.contract_id, case.id.split("[", 1)[0]):
        return True
    return any(ch in pattern for ch in "*?") and (fnmatch.fnmatchcase(case.id, pattern) or fnmatch.fnmatchcase(case.contract_id, pattern))


def select_cases(args: argparse.Namespace) -> list[Case]:
    """The cases ``args`` ask for (ids, world size, overrides); ConfigError when a selector matches nothing."""
    cases = load_cases(args.cases or default_cases_dir(), platform_of_device(getattr(args, "device", "cpu")))
    ids: Sequence[str] = getattr(args, "ids", None) or []
    for pattern in ids:
        if not any(_matches(c, pattern) for c in cases):
            known = sorted({c.contract_id for c in cases})
            raise ConfigError(f"no case matches {pattern!r}; contracts with cases: {', '.join(known)}", key="ID")
    if ids:
        cases = [c for c in cases if any(_matches(c, p) for p in ids)]
    world = getattr(args, "world_size", None)
    if world is not None:
        cases = [c for c in cases if c.world_size == world]
        if not cases:
            raise ConfigError(f"no selected case runs at world size {world}", key="--world-size")
    return with_overrides(
        cases, backend=getattr(args, "backend", None), dtype=getattr(args, "dtype", None), sdpa_kernel=getattr(args, "sdpa_kernel", None)
    )


def check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but torch sees no CUDA device", key="--device")


@dataclass
class ContractRun:
    verdicts: list[Verdict]
    wall_s: float
    pool_startup_s: dict[int, float]  # starting each world size's group, not counted in any case

    def timing(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "cases_s": sum(v.duration_s for v in self.verdicts),
            "pool_startup_s": {str(w): s for w, s in sorted(self.pool_startup_s.items())},
        }


def run_contract_cases(
    cases: Sequence[Case], args: argparse.Namespace, err: Console, label: str = "contracts", pools: PoolSet | None = None
) -> ContractRun:
    """Run ``cases`` with a progress bar on ``err``, one pool per world size.

    With ``pools`` (the gate's, shared by its stages) the groups are borrowed and left running;
    without, this call starts them and closes each after its last case.
    """
    from harness.runner import PoolSet, run_cases
    from harness.targets.loader import parse_target_args

    check_device(args.device)
    target_args = parse_target_args(getattr(args, "target_arg", []))
    start = time.perf_counter()
    with progress(err, len(cases), label) as advance:
        if pools is None:
            with PoolSet(args.device) as own:
                verdicts = run_cases(cases, args.target, args.device, pools=own, timeout=args.timeout, on_verdict=advance,
                                     target_args=target_args)
            startup = own.startup_s
        else:
            pools.prestart(c.world_size for c in cases)
            verdicts = run_cases(cases, args.target, args.device, pools=pools.get, timeout=args.timeout, on_verdict=advance,
                                 target_args=target_args)
            startup = pools.startup_s
    return ContractRun(verdicts, time.perf_counter() - start, dict(startup))


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from harness.targets.loader import parse_target_args

    from reference_impl.platform import current_platform

    return {
        "target": args.target,
        "target_args": dict(parse_target_args(getattr(args, "target_arg", []))),
        "device": args.device,
        "platform": current_platform.label(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }


def summary(verdicts: Sequence[Verdict]) -> dict[str, int]:
    return {s: sum(v.status == s for v in verdicts) for s in (PASSED, FAILED, SKIPPED)}


def run(args: argparse.Namespace) -> int:
    from harness.baselines.atomic import write_json_atomic
    from harness.report_junit import junit_from_verdicts, write_junit

    cases = select_cases(args)
    out, err = make_console(), make_console(stderr=True)
    result = run_contract_cases(cases, args, err)
    verdicts = result.verdicts
    out.print(verdict_table(verdicts))
    out.print(summary_line(verdicts, result.wall_s))
    starts = ", ".join(f"W={w} {t:.1f} s" for w, t in sorted(result.pool_startup_s.items()))
    out.print(f"cases {result.timing()['cases_s']:.1f} s; rank groups started in the background ({starts or 'none'})")
    for v in verdicts:
        if v.status == FAILED and "traceback" in v.figures:
            print(f"\n--- {v.case_id}: {v.reason}\n{v.figures['traceback']}", file=sys.stderr)
    if args.json:
        document = {"command": "check", **environment(args), **result.timing(), "summary": summary(verdicts),
                    "verdicts": [v.to_dict() for v in verdicts]}
        write_json_atomic(args.json, document)
    if args.junit:
        write_junit(args.junit, junit_from_verdicts(verdicts))
    return 1 if any(v.status == FAILED for v in verdicts) else 0
