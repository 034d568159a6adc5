"""The gate's perf stage: time every image case and check it against this machine's perf baseline.

Per case (:func:`harness.timing.time_image_case`): warm-up runs, then ``--perf-runs`` timed
ones, the median of each value; the check is sglang's, ``actual <= expected * (1 + tol)`` per
value (e2e, each stage, each step, average/median step) with the tolerances of
``--perf-profile`` (env ``PARITY_PERF_TOL_*`` overrides them; see :mod:`harness.baselines.perf`).
The baseline is :meth:`PerfBaselines.for_platform` of this hardware: the perf overlay
``<baselines>/platforms/perf/<platform>.json`` (or base scenarios that name this platform).

On by default only where such a baseline exists: timings are a property of one machine, and
gating a CPU runner against numbers from another machine (or from itself on a noisy day) would
fail CI on noise. Where none exists the gate says so and how to make one. ``--perf`` forces
the stage: every case is measured and, without a baseline, reported skipped with that reason;
its results.json then carries the measurements (top-level ``perf``) that
``parity recalibrate perf`` turns into a new overlay. ``--no-perf`` turns it off.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

from rich.markup import escape
from rich.table import Table

from harness.baselines.perf import PROFILES
from harness.contracts.verdict import FAILED, PASSED, SKIPPED
from harness.report_junit import JUnitCase

if TYPE_CHECKING:
    from harness.baselines.perf import PerfBaselines, PerfCheck, Tolerances
    from harness.commands.gate import GateContext, StageResult

DEFAULT_RUNS = 3
DEFAULT_WARMUP = 1
DEFAULT_CASE_TIMEOUT_S = 600.0


def add_perf_options(parser: argparse.ArgumentParser) -> None:
    """``parity gate``'s perf options."""
    group = parser.add_argument_group("perf stage (timings of the image cases)")
    group.add_argument("--perf", action=argparse.BooleanOptionalAction, default=None,
                       help="time the image cases against this machine's perf baseline (default: on only where one "
                       "exists, baselines/platforms/perf/<platform>.json; --perf without one measures for recalibration)")
    group.add_argument("--perf-runs", type=_count(1), default=DEFAULT_RUNS, metavar="N",
                       help=f"timed runs per case; their median is checked (default {DEFAULT_RUNS})")
    group.add_argument("--perf-warmup", type=_count(0), default=DEFAULT_WARMUP, metavar="N",
                       help=f"untimed warm-up runs per case (default {DEFAULT_WARMUP})")
    group.add_argument("--perf-profile", default="pr_test", choices=PROFILES, help="tolerance profile (default pr_test)")


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def how_to_create(platform: str) -> str:
    """The commands that give a machine its perf baseline."""
    return (f"to create one, run `parity gate --perf --report DIR` 3 times on this machine, then "
            f"`parity recalibrate perf --results DIR*/results.json --write` (writes platforms/perf/{platform}.json)")


def machine_baseline(ctx: GateContext, platform: str) -> PerfBaselines | None:
    """This machine's perf baselines, or None when the base file is absent."""
    from harness.baselines.perf import PERF_BASE_FILE, PerfBaselines

    if not (ctx.baselines_dir / PERF_BASE_FILE).is_file():
        return None
    return PerfBaselines.for_platform(ctx.baselines_dir, platform)


def failed_checks(checks: list[PerfCheck]) -> list[str]:
    """One line per value over its limit: ``stages_ms.DenoisingStage 35.2 > 30 (25 ms +20%)``, or
    ``(0.5 ms + 1 ms floor)`` where the absolute floor set the limit."""
    lines = []
    for c in checks:
        if c.passed:
            continue
        actual = "not measured" if c.actual is None else f"{c.actual:.4g}"
        relative = c.expected * (1.0 + c.tol)
        slack = f"+{c.tol:.0%}" if c.limit <= relative * (1 + 1e-9) else f"+ {c.limit - c.expected:.3g} ms floor"
        lines.append(f"{c.metric} {actual} > {c.limit:.4g} ({c.expected:.4g} ms {slack})")
    return lines


class PerfStage:
    """Timings of every image case under ``<cases>/images`` against this machine's perf baseline."""

    name = "perf"

    def skip_reason(self, ctx: GateContext) -> str | None:
        from harness.baselines.perf import PERF_BASE_FILE
        from harness.baselines.platforms import platform_name
        from harness.image_cases import image_case_dir

        choice = ctx.args.perf
        if choice is False:
            return "--no-perf"
        directory = image_case_dir(ctx.cases_root)
        if not directory.is_dir():
            return f"no image cases to time ({directory} does not exist)"
        if choice:
            return None
        platform = platform_name(ctx.args.device)
        baseline = machine_baseline(ctx, platform)
        if baseline is None:
            return f"no {PERF_BASE_FILE} in {ctx.baselines_dir}"
        if not baseline.scenario_ids:
            return f"no perf baseline for hardware '{platform}'; {how_to_create(platform)}"
        return None

    def run(self, ctx: GateContext) -> StageResult:
        from harness.baselines.platforms import platform_name
        from harness.commands.gate import StageResult
        from harness.console import progress
        from harness.image_cases import load_image_cases
        from harness.timing import hardware_name, time_image_case

        args = ctx.args
        device = args.device
        platform = platform_name(device)
        baseline = machine_baseline(ctx, platform)
        profile = args.perf_profile
        tolerances = baseline.tolerances(profile) if baseline is not None else None  # env overrides apply
        runs, warmup = args.perf_runs, args.perf_warmup
        cases = sorted(load_image_cases(ctx.cases_root), key=lambda c: c.world_size)
        timeout = args.timeout or DEFAULT_CASE_TIMEOUT_S

        start = time.perf_counter()
        records: list[dict[str, Any]] = []
        measured_all: dict[str, dict[str, Any]] = {}
        pools = ctx.pools  # shared by the gate's stages: groups started once
        with progress(ctx.err, len(cases), self.name) as advance:
            pools.prestart(c.world_size for c in cases)
            for case in cases:
                pools.get(case.world_size)  # a case's duration excludes starting its group
                t0 = time.perf_counter()
                measured = time_image_case(case, pools, device, runs=runs, warmup=warmup, timeout=timeout).measured()
                measured_all[case.id] = measured
                expected = baseline.scenario(case.id) if baseline is not None else None
                record = _judge(case.id, case.world_size, measured, expected, tolerances, platform)
                record["duration_s"] = time.perf_counter() - t0
                records.append(record)
                advance(cast(Any, SimpleNamespace(case_id=case.id, status=record["status"])))
            startup = dict(pools.startup_s)
        wall = time.perf_counter() - start

        ctx.out.print(perf_table(records, f"gate: perf ({platform}, median of {runs} after {warmup} warm-up)"))
        count = {s: sum(r["status"] == s for r in records) for s in (PASSED, FAILED, SKIPPED)}
        ctx.out.print(f"perf: {count[PASSED]} passed, {count[FAILED]} failed, {count[SKIPPED]} skipped in {wall:.1f} s")
        return StageResult(
            self.name, records, [_junit(r, self.name) for r in records],
            count[PASSED], count[FAILED], count[SKIPPED], wall,
            extra={
                "platform": platform,
                "baseline_files": baseline.paths if baseline is not None else [],
                "profile": profile,
                "tolerances": dataclasses.asdict(tolerances) if tolerances is not None else None,
                "pool_startup_s": {str(w): s for w, s in sorted(startup.items())},
            },
            top_level={"platform": platform, "device_name": hardware_name(device), "perf": measured_all},
        )


def _judge(case_id: str, world_size: int, measured: dict[str, Any], expected: dict[str, Any] | None,
           tolerances: Tolerances | None, platform: str) -> dict[str, Any]:
    """One record: the figures, and the verdict against the baseline scenario (if any)."""
    from harness.baselines.perf import check_perf

    figures = {
        "e2e_ms": measured["expected_e2e_ms"],
        "denoise_ms": measured["stages_ms"]["DenoisingStage"],
        "median_step_ms": measured.get("expected_median_denoise_ms"),
        "peak_memory_mb": measured["peak_memory_mb"],
        "peak_memory_kind": measured["peak_memory_kind"],
        "clock": measured["clock"],
    }
    record: dict[str, Any] = {"case_id": case_id, "world_size": world_size, "figures": figures, "measured": measured}
    if expected is None or tolerances is None:
        record.update(status=SKIPPED, reason=f"no perf baseline for scenario '{case_id}' on '{platform}'")
        return record
    checks = check_perf(expected, measured, tolerances, abs_floor_ms=tolerances.abs_floor_ms)
    problems = failed_checks(checks)
    figures["expected_e2e_ms"] = expected["expected_e2e_ms"]
    record["checks"] = [dataclasses.asdict(c) for c in checks]
    record.update(status=FAILED if problems else PASSED, reason="; ".join(problems) or None,
                  bound=f"{len(checks)} values within their tolerance")
    return record


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def perf_table(records: list[dict[str, Any]], title: str) -> Table:
    style = {PASSED: "green", FAILED: "bold red", SKIPPED: "yellow"}
    table = Table(title=escape(title))
    for column in ("case", "W", "status", "e2e ms", "expected", "denoise ms", "step ms", "peak MB", "reason"):
        table.add_column(column, overflow="fold")
    for r in records:
        f = r["figures"]
        table.add_row(escape(r["case_id"]), str(r["world_size"]), f"[{style[r['status']]}]{r['status']}[/]",
                      _fmt(f["e2e_ms"]), _fmt(f.get("expected_e2e_ms")), _fmt(f["denoise_ms"]), _fmt(f["median_step_ms"]),
                      _fmt(f["peak_memory_mb"]), escape(r.get("reason") or ""))
    return table


def _junit(record: dict[str, Any], suite: str) -> JUnitCase:
    import json

    return JUnitCase(suite, "perf.image", record["case_id"], record["duration_s"], record["status"], record.get("reason"),
                     json.dumps(record["figures"], sort_keys=True))
