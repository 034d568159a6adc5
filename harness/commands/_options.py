"""Options several verbs share, declared once so they read the same everywhere, and turned into typed options here."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.contracts.params import MAX_WORLD_SIZE
from harness.contracts.runner import RunOptions
from harness.errors import ConfigError, ParamError
from harness.paths import SUITES, default_baselines_dir, default_cases_dir, is_inside_package, suite_dir
from harness.project import Project
from harness.targets.loader import BUILTIN_PIPELINES, BUILTIN_TARGETS
from harness.targets.spec import TargetSpec, parse_target_args

FROM_PROJECT = "the project file's, else"  # how a default that a project file can set reads in --help


def seconds(text: str) -> float:
    """argparse type of a timeout: a finite number of seconds > 0 (argparse exits 2 naming the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def count(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """argparse type of a count: an integer >= ``minimum`` (and <= ``maximum``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"in [{minimum}, {maximum}]" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


world_size = count(1, MAX_WORLD_SIZE)  # argparse type of a world size


def check_backends(
    options: RunOptions, backends: Sequence[tuple[str | None, str | None]], flags: Mapping[str, str]
) -> None:
    """Backend names (with a pinned SDPA kernel) from the command line, judged by the target before
    any work; ``flags`` names the option of each ParamError key (``backend`` -> ``--backend``)."""
    target = options.load()
    for backend, kernel in backends:
        try:
            target.check_backend(backend, kernel)
        except ParamError as exc:
            raise ConfigError(str(exc), key=flags[exc.key]) from None


def add_cases(parser: argparse.ArgumentParser) -> None:
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument(
        "--cases",
        type=Path,
        default=None,
        metavar="DIR",
        help="cases root (contracts/ and images/ hold the case files) or a directory of *.toml contract case "
        f"files (default: {FROM_PROJECT} {default_cases_dir()})",
    )
    chosen.add_argument(
        "--suite",
        choices=sorted(SUITES),
        default=None,
        help="one of the case sets parity ships instead of the default cases: "
        + "; ".join(f"{name}: {what}" for name, what in sorted(SUITES.items())),
    )


def add_baselines(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baselines",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"baselines directory (default: {FROM_PROJECT} {default_baselines_dir()})",
    )


def json_target(text: str) -> Path | str:
    """``--json FILE``: ``-`` (stdout) or a name ending in .json, so a case id after ``--json`` is not taken for a file."""
    if text == "-":
        return text
    if not text.endswith(".json"):
        raise argparse.ArgumentTypeError(
            f"expected FILE.json, or - for stdout; got {text!r} (to select cases, name them before the options)"
        )
    return Path(text)


def add_json(parser: argparse.ArgumentParser, what: str) -> None:
    """The one ``--json FILE`` of every verb."""
    parser.add_argument(
        "--json",
        type=json_target,
        default=None,
        metavar="FILE",
        help=f"write {what} as JSON to FILE (- for stdout; tables then go to stderr)",
    )


def add_outputs(parser: argparse.ArgumentParser) -> None:
    add_json(parser, "the results (every figure)")
    parser.add_argument("--junit", type=Path, default=None, metavar="FILE", help="write JUnit XML for CI")


def add_tables(parser: argparse.ArgumentParser) -> None:
    """``-q`` / ``--failures-only``: how much of the result tables to print (the summaries and the verdict always are)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "-q",
        "--quiet",
        dest="tables",
        action="store_const",
        const="none",
        default="all",
        help="no result tables: the summary lines and the verdict with each failing case only",
    )
    group.add_argument(
        "--failures-only",
        dest="tables",
        action="store_const",
        const="failures",
        help="result tables with the failing and undecided cases only",
    )


def add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default=None, choices=("cpu", "cuda"), help=f"device of the ranks (default: {FROM_PROJECT} cpu)"
    )


def add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=None,
        metavar="T",
        help=f"implementation under test: {', '.join(BUILTIN_TARGETS)}, or module:factory (default: {FROM_PROJECT} reference)",
    )
    parser.add_argument(
        "--target-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the target's factory (repeatable), e.g. layer=pkg.mod:Class",
    )
    add_device(parser)
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=None,
        metavar="S",
        help="per-case timeout in seconds, > 0 (default: the contract's)",
    )
    parser.add_argument(
        "--allow-new-skips",
        action="store_true",
        help="a skip the target's overlay does not pin stays a skip instead of failing its case (an exploratory run)",
    )


def add_pipeline_target(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--pipeline-target",
        default=None,
        metavar="P",
        help=f"pipeline {what} for image cases that name no `target`: {', '.join(BUILTIN_PIPELINES)}, "
        f"or module:factory (default: {FROM_PROJECT} reference)",
    )
    parser.add_argument(
        "--pipeline-target-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the pipeline target's factory (repeatable), e.g. path=DIR for diffusers",
    )


def fraction(text: str) -> float:
    """argparse type of a confidence: a number in (0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text!r}")
    return value


def add_ab_sampling(group: argparse._ArgumentGroup, prefix: str) -> None:
    """How an A/B samples (``--{prefix}warmup``, ``min-pairs``, ``max-pairs``, ``max-time``, ``launches``,
    ``confidence``, ``replicas``, ``overlap-launches``, ``inconclusive``), one :class:`~harness.perf.sampling.Sampling` field each but
    the last."""
    from harness.gate.stage import INCONCLUSIVE_POLICIES
    from harness.perf.sampling import Sampling

    d = Sampling()
    options: list[tuple[str, Callable[[str], Any], object, str, str]] = [
        ("warmup", count(0), d.warmup, "N", "untimed warm-up runs per side and case"),
        ("min-pairs", count(1), d.min_pairs, "N", "A/B: BASE+HEAD pairs before the first verdict"),
        ("max-pairs", count(1), d.max_pairs, "N", "A/B: the most pairs per case; a figure still undecided then is "
         "inconclusive"),
        ("max-time", seconds, d.max_time_s, "S", "A/B: seconds per case at most, launches included; no launch block "
         "(or pair) is started that would end later, and a figure still undecided then is inconclusive"),
        ("launches", count(1), d.launches, "N", "A/B: start each side afresh (rank processes, a launched server) at "
         "least N times before the first verdict (a launch of --replicas R starts R of each), pairs spread over them, "
         "so that one process's bias is not read as a difference (1: one each)"),
        ("confidence", fraction, d.confidence, "C", "A/B: confidence of each figure's HEAD/BASE interval"),
        ("replicas", count(1), d.replicas, "N", "A/B of sides outside rank groups (servers): start N instances of "
         "each side per launch, alive together, pairs rotating over them one at a time; each pair of instances "
         "is a launch block of its own (a process's bias and a server's slow spells are its own), so one start gives "
         "N blocks; for a machine with memory for 2N servers (4N with --overlap-launches)"),
    ]  # fmt: skip
    for name, kind, default, metavar, text in options:
        group.add_argument(
            f"--{prefix}{name}", type=kind, default=default, metavar=metavar, help=f"{text} (default {default:g})"
        )
    group.add_argument(
        f"--{prefix}overlap-launches",
        action="store_true",
        help="A/B of sides outside rank groups (servers): start each launch block's sides while the block before runs "
        "its pairs, so that a launch costs its warm-up, not its start; both blocks' servers are alive at once, for a "
        "machine with cores and device memory to spare (a start that fails beside a live block is retried after it)",
    )
    group.add_argument(
        f"--{prefix}inconclusive",
        choices=INCONCLUSIVE_POLICIES,
        default="fail",
        help="A/B: an undecided case fails the run (exit 3 when nothing failed; default) or passes it",
    )


def ab_sampling(args: argparse.Namespace, prefix: str):
    """The :class:`~harness.perf.sampling.Sampling` of :func:`add_ab_sampling`'s options, checked together."""
    from harness.perf.sampling import Sampling, SamplingError

    dest = prefix.replace("-", "_")
    try:
        return Sampling(
            getattr(args, f"{dest}warmup"),
            getattr(args, f"{dest}min_pairs"),
            getattr(args, f"{dest}max_pairs"),
            getattr(args, f"{dest}max_time"),
            getattr(args, f"{dest}confidence"),
            getattr(args, f"{dest}launches"),
            overlap=getattr(args, f"{dest}overlap_launches"),
            replicas=getattr(args, f"{dest}replicas"),
        )
    except SamplingError as exc:
        option = f"--{prefix}{exc.field.replace('_', '-')}"
        raise ConfigError(str(exc).replace(exc.field, option, 1), key=option) from None


def project(args: argparse.Namespace) -> Project | None:
    """The project file in effect (found by the CLI from the working directory upwards before the verb runs)."""
    return getattr(args, "project", None)


def _chosen(args: argparse.Namespace, option: str) -> TargetSpec:
    """A target spec and its factory args: ``--X`` replaces the project file's spec and args, ``--X-arg``
    alone only its args; else the project file's, else the reference without args."""
    name, items = getattr(args, option), getattr(args, f"{option}_arg")
    given = parse_target_args(items, f"--{option.replace('_', '-')}-arg")
    p = project(args)
    if name is not None:
        return TargetSpec(name, given)
    bare = p.spec_of(option) if p else TargetSpec()
    return TargetSpec(bare.name, given) if items else bare


def pipeline_target(args: argparse.Namespace) -> TargetSpec:
    """``--pipeline-target`` and its ``--pipeline-target-arg`` pairs (checked), or the project file's ``pipeline_target*``."""
    return _chosen(args, "pipeline_target")


def device(args: argparse.Namespace) -> str:
    """``--device``, else the project file's ``device``, else cpu."""
    p = project(args)
    return args.device or (p and p.device) or "cpu"


def perf_profile(value: str | None, args: argparse.Namespace) -> str | None:
    """A perf tolerance profile given on the command line, else the project file's ``profile`` (None: the verb's default)."""
    p = project(args)
    return value or (p.profile if p else None)


def run_options(args: argparse.Namespace) -> RunOptions:
    """The typed run options of the ``--target/--target-arg/--device/--timeout`` arguments (and the project file)."""
    return RunOptions(_chosen(args, "target"), device(args), args.timeout, args.allow_new_skips)


def cases_root(args: argparse.Namespace) -> Path:
    if getattr(args, "suite", None):
        return suite_dir(args.suite)
    p = project(args)
    return args.cases or (p and p.cases) or default_cases_dir()


def baselines_dir(args: argparse.Namespace) -> Path:
    p = project(args)
    return args.baselines or (p and p.baselines) or default_baselines_dir()


def existing_baselines_dir(args: argparse.Namespace) -> Path:
    """:func:`baselines_dir`, refused when it is not a directory (naming ``--baselines`` or the project key that chose it)."""
    directory = baselines_dir(args)
    if not directory.is_dir():
        p = project(args)
        if args.baselines is None and p is None:
            raise ConfigError(
                "parity's own baselines are not here: run `parity init` to make a project with its own "
                "baselines, or set PARITY_HOME to a checkout of parity",
                path=directory,
            )
        raise ConfigError("no such baselines directory", path=directory, key="--baselines")
    return directory


def writable_baselines_dir(args: argparse.Namespace) -> Path:
    """:func:`existing_baselines_dir` for a verb that writes into it: never the installed package's embedded
    defaults, and never parity's own baselines while a project file is in use (its writes belong to the project)."""
    directory = existing_baselines_dir(args)
    p = project(args)
    if is_inside_package(directory):
        raise ConfigError(
            "these are the defaults inside the installed parity package, never written: run `parity init` "
            "to make a project (parity.toml) whose baselines take the writes, or set PARITY_HOME to a "
            "checkout of parity",
            path=directory,
            key="--baselines" if args.baselines else None,
        )
    if p is not None and directory.resolve().is_relative_to(default_baselines_dir().resolve()):
        raise ConfigError(
            f"the project file {p.file} is in use, so writes go to its baselines"
            f"{f' ({p.baselines})' if p.baselines else ''}, not to parity's own",
            path=directory,
            key="--baselines" if args.baselines else p.key("baselines"),
        )
    return directory
