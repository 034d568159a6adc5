"""Where a served A/B's noise comes from: per-request times of `parity serve` alone, beside a second live server
(requests alternated ABBA, as `parity perf openai openai` runs them), and again alone after the second has ended.

Each request's time is the server's own (``inference_time_s``) and the round trip. The spread within one server's
requests, and whether it changes with a second server alive, say whether two live servers on one GPU disturb each
other (then launch blocks should alternate, one server at a time) or the noise is the server's own.

    python benchmarks/served_noise.py --device cuda --height 256 --width 256 --steps 40 --requests 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from harness.targets.openai_images import ENDPOINT, post, request_body
from harness.targets.served import LaunchedServer


def timed(server: LaunchedServer, fields: dict[str, object]) -> tuple[float, float]:
    """One request: the server's inference time and the round trip, in ms."""
    answer, round_trip_ms = post(server.url + ENDPOINT, request_body(fields, None, None), timeout=600.0)
    return 1e3 * float(json.loads(answer)["inference_time_s"]), round_trip_ms


def summary(label: str, values: list[float]) -> str:
    q = statistics.quantiles(values, n=10)
    return (
        f"{label:28} n={len(values):3}  median {statistics.median(values):8.1f} ms  p10 {q[0]:8.1f}  p90 {q[-1]:8.1f}"
        f"  min {min(values):8.1f}  max {max(values):8.1f}  spread p90/p10 {q[-1] / q[0]:.3f}"
    )


def series(servers: list[LaunchedServer], fields: dict[str, object], requests: int, warmup: int) -> list[list[float]]:
    """``requests`` rounds over ``servers`` in ABBA order after ``warmup`` rounds; per server its inference times."""
    for _ in range(warmup):
        for s in servers:
            timed(s, fields)
    times: list[list[float]] = [[] for _ in servers]
    for i in range(requests):
        order = list(enumerate(servers)) if i % 2 == 0 else list(reversed(list(enumerate(servers))))
        for index, s in order:
            times[index].append(timed(s, fields)[0])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--env", default="", help="prefix for the server command (e.g. 'env OMP_NUM_THREADS=1')")
    args = parser.parse_args()
    launch = f"{args.env} {sys.executable} -m harness.cli serve --port {{port}} --device {args.device}".strip()
    fields = {"prompt": "a red fox", "width": args.width, "height": args.height, "num_inference_steps": args.steps}
    first = LaunchedServer(launch, ready_timeout=300.0)
    try:
        (alone,) = series([first], fields, args.requests, args.warmup)
        print(summary("A alone", alone), flush=True)
        second = LaunchedServer(launch, ready_timeout=300.0)
        try:
            a, b = series([first, second], fields, args.requests, args.warmup)
            print(summary("A beside live B (ABBA)", a), flush=True)
            print(summary("B beside live A (ABBA)", b), flush=True)
            ratios = [y / x for x, y in zip(a, b)]
            print(summary("B/A per round (x1000)", [1e3 * r for r in ratios]), flush=True)
        finally:
            second.stop()
        (after,) = series([first], fields, args.requests, 0)
        print(summary("A alone again", after), flush=True)
        print("A alone, in order:", " ".join(f"{v:.0f}" for v in alone))
        print("A beside B, in order:", " ".join(f"{v:.0f}" for v in a))
    finally:
        first.stop()


if __name__ == "__main__":
    main()
