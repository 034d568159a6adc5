"""How often each perf verdict is wrong on this machine: the false-alarm rate (BASE = HEAD) and the detection
rate of a planted 10 % slowdown, for the A/B verdict and for absolute baselines, measured side by side.

Per workload an absolute baseline is recorded first (as ``parity recalibrate perf`` makes one); then each
repetition makes, interleaved, A/B and absolute verdicts on an unchanged and a 10 % slower HEAD, absolute mode at
sglang's pr_test tolerances and at the A/B's 5 %. Workloads: ``reference`` (the tiny pipeline, 16x16, 2 steps)
and ``command`` (tests/targets/sleep_generator.py). The method in full and the figures: docs/perf.md, "Measured".

    .venv/bin/python benchmarks/perf_gate.py [--repetitions 20] [--workloads reference command] [--neighbour]
        [--device cpu|cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harness.baselines.perf import DEFAULT_AB_TOLERANCES, PerfBaselines, check_perf, scenario_values
from harness.baselines.tolerances import Tolerances
from harness.perf import absolute
from harness.perf.ab import compare
from harness.perf.sampling import Sampling
from harness.pipelines.sessions import PipelineRun, Session
from harness.ranks import PoolSet
from harness.targets.spec import TargetSpec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's test targets, as `parity perf` finds them from its root
from tests.targets import sleep_generator  # noqa: E402

SLOWDOWN = 0.1
REFERENCE_FIELDS = {"weights": "tiny-v1", "prompt": "a cameraman", "height": 16, "width": 16, "steps": 2}
TEMPLATE = sleep_generator.template()
PR_TEST = PerfBaselines.load(REPO / "baselines" / "perf_baselines.json").tolerances("pr_test")
VERDICTS = ("failed", "inconclusive", "passed")


def workload(name: str) -> tuple[PipelineRun, PipelineRun]:
    """The unchanged and the 10 % slower pipeline of a workload."""
    if name == "reference":
        return (
            PipelineRun(TargetSpec("reference", ()), REFERENCE_FIELDS, 1),
            PipelineRun(
                TargetSpec("tests.targets.slow_pipeline:factory", (("fraction", str(SLOWDOWN)),)), REFERENCE_FIELDS, 1
            ),
        )
    return (
        PipelineRun(TargetSpec("command", (("template", TEMPLATE),)), sleep_generator.FIELDS, 1),
        PipelineRun(TargetSpec("command", (("template", f"{TEMPLATE} --slow {SLOWDOWN}"),)), sleep_generator.FIELDS, 1),
    )


def absolute_verdict(session: Session, baseline: dict[str, Any], tolerances: Tolerances, runs: int) -> str:
    measured = absolute.measure(session, runs=runs, warmup=1)
    return "passed" if all(c.passed for c in check_perf(baseline, measured, tolerances)) else "failed"


def ab_verdict(base: Session, head: Session, sampling: Sampling) -> tuple[str, int]:
    comparison = compare(base, head, sampling, DEFAULT_AB_TOLERANCES)
    verdict = "failed" if comparison.failed else "inconclusive" if comparison.undecided else "passed"
    return verdict, comparison.pairs


@contextmanager
def neighbour(active: bool) -> Iterator[None]:
    """A busy loop in another process while the block runs (when ``active``)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if active else None
    try:
        yield
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def run(name: str, args: argparse.Namespace, pools: PoolSet) -> list[dict[str, Any]]:
    same_run, slow_run = workload(name)
    sampling = Sampling(max_pairs=args.max_pairs)
    tally: dict[str, Counter[str]] = {
        key: Counter() for key in ("ab same", "ab slow", "pr_test same", "pr_test slow", "5% same", "5% slow")
    }
    pairs: list[int] = []
    seconds: dict[str, list[float]] = {"ab": [], "absolute": []}
    with (
        Session(same_run, pools, tag="base") as base,
        Session(same_run, pools, tag="head") as head,
        Session(slow_run, pools, tag="slow") as slow,
    ):
        measured = [absolute.measure(base, runs=args.runs, warmup=1) for _ in range(3)]
        baseline = absolute.median_scenario([scenario_values(m) for m in measured])
        five = Tolerances(e2e=0.05, denoise_stage=0.05, non_denoise_stage=0.05, denoise_step=0.05, denoise_agg=0.05)
        for rep in range(args.repetitions):
            with neighbour(args.neighbour and rep % 2 == 1):
                for label, head_side in (("same", head), ("slow", slow)):
                    t0 = time.perf_counter()
                    verdict, n = ab_verdict(base, head_side, sampling)
                    seconds["ab"].append(time.perf_counter() - t0)
                    tally[f"ab {label}"][verdict] += 1
                    pairs.append(n)
                    t0 = time.perf_counter()
                    for tol_name, tol in (("pr_test", PR_TEST), ("5%", five)):
                        tally[f"{tol_name} {label}"][absolute_verdict(head_side, baseline, tol, args.runs)] += 1
                    seconds["absolute"].append((time.perf_counter() - t0) / 2)
            print(
                f"  {name} repetition {rep + 1}/{args.repetitions}: "
                + ", ".join(f"{k} {dict(v)}" for k, v in tally.items()),
                file=sys.stderr,
                flush=True,
            )
    rows = []
    for mode, same, slow, secs in (
        ("A/B (5 %, ABBA pairs)", "ab same", "ab slow", seconds["ab"]),
        ("absolute, pr_test (25 %)", "pr_test same", "pr_test slow", seconds["absolute"]),
        ("absolute, 5 %", "5% same", "5% slow", seconds["absolute"]),
    ):
        rows.append(
            {
                "workload": name,
                "mode": mode,
                "false_alarm": tally[same]["failed"],
                "inconclusive_same": tally[same]["inconclusive"],
                "detected": tally[slow]["failed"],
                "inconclusive_slow": tally[slow]["inconclusive"],
                "missed": tally[slow]["passed"],
                "repetitions": args.repetitions,
                "seconds_per_verdict": statistics.median(secs),
                **({"median_pairs": statistics.median(pairs)} if mode.startswith("A/B") else {}),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--workloads", nargs="+", default=["reference", "command"], choices=("reference", "command"))
    parser.add_argument("--runs", type=int, default=5, help="timed runs per absolute measurement")
    parser.add_argument("--max-pairs", type=int, default=Sampling().max_pairs)
    parser.add_argument("--neighbour", action="store_true", help="a busy loop during every other repetition")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with PoolSet(args.device) as pools:
        for name in args.workloads:
            rows += run(name, args, pools)
    print(
        f"\n{args.repetitions} repetitions per row; a 10 % slowdown of every denoising step; "
        f"neighbour: {'every other repetition' if args.neighbour else 'none'}"
    )
    print(
        f"{'workload':10} {'mode':26} {'BASE=HEAD failed':>17} {'inconclusive':>13} {'slow detected':>14} "
        f"{'inconclusive':>13} {'missed':>7} {'s/verdict':>10} {'pairs':>6}"
    )
    for r in rows:
        print(
            f"{r['workload']:10} {r['mode']:26} {r['false_alarm']:>11}/{r['repetitions']:<5} {r['inconclusive_same']:>13} "
            f"{r['detected']:>8}/{r['repetitions']:<5} {r['inconclusive_slow']:>13} {r['missed']:>7} "
            f"{r['seconds_per_verdict']:>10.2f} {r.get('median_pairs', ''):>6}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
