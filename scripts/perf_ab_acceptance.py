"""The perf A/B's acceptance run: N independent A/Bs per pipeline, BASE = HEAD and HEAD with every denoising step
10 % slower, through `parity perf` itself; prints the verdict counts.

The cases root holds N copies of each image case (``<case>__<i>``), each an A/B of its own inside one `parity perf`
run, so the rank groups start once and the same processes serve every copy: a process slower for good shows in
every copy, so the false-alarm count is, if anything, pessimistic. Pipelines: the built-in one (``--cases``,
slowed by tests/targets/slow_pipeline.py) and a command (tests/targets/sleep_generator.py); docs/perf.md, "Measured".

    python scripts/perf_ab_acceptance.py --device cuda --copies 10 --out DIR [--cases zimage_t2i_1rank ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.targets import sleep_generator  # noqa: E402 - the checkout's own test targets

EXTRA: list[str] = []  # --perf-args
TEMPLATE = sleep_generator.template()  # the interpreter's whole start, as a real command has one


def toml_value(value: object) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return (
        json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    )


def write_copies(root: Path, defaults: dict, cases: dict[str, dict], copies: int) -> Path:
    (root / "images").mkdir(parents=True)
    lines = ["[defaults]", *(f"{k} = {toml_value(v)}" for k, v in defaults.items())]
    for case_id, body in cases.items():
        for i in range(copies):
            lines += ["", f"[cases.{case_id}__{i}]", *(f"{k} = {toml_value(v)}" for k, v in body.items())]
    (root / "images" / "copies.toml").write_text("\n".join(lines) + "\n")
    return root


def perf(label: str, out: Path, cases: Path, device: str, *argv: str) -> dict[str, object]:
    path = out / f"{label}.json"
    command = [
        sys.executable,
        "-m",
        "harness.cli",
        "perf",
        *argv,
        "--cases",
        str(cases),
        "--device",
        device,
        "--json",
        str(path),
        *EXTRA,
    ]
    code = subprocess.run(command, cwd=REPO, stdout=subprocess.DEVNULL).returncode
    records = json.loads(path.read_text())["stages"]["perf"]["records"]
    by_case: dict[str, Counter[str]] = {}
    for r in records:
        by_case.setdefault(r["case_id"].rsplit("__", 1)[0], Counter())[r["status"]] += 1
    pairs = sorted(r["figures"].get("pairs", 0) for r in records)
    return {
        "label": label,
        "exit": code,
        "verdicts": {c: dict(v) for c, v in by_case.items()},
        "median_pairs": pairs[len(pairs) // 2] if pairs else None,
        "wall_s": json.loads(path.read_text())["wall_s"],
        "records": [_line(r) for r in records],
    }


def _line(record: dict) -> str:
    """One A/B: status, BASE's e2e, HEAD/BASE with its interval, pairs, launches, how long it took."""
    f = record["figures"]
    ratio = f"x{f['e2e_ratio']:.3f} [{f['e2e_ratio_low']:.3f}, {f['e2e_ratio_high']:.3f}]" if "e2e_ratio" in f else "-"
    return (
        f"{record['case_id']} {record['status']} base e2e {f.get('e2e_base_ms', 0):.1f} ms {ratio} "
        f"{f.get('pairs')} pairs {f.get('launches')} launches {record['duration_s']:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["zimage_t2i_1rank", "zimage_t2i_2ranks"],
        help="built-in image cases of cases/images/pipelines.toml to copy",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--pipelines", nargs="+", default=["builtin", "command"], choices=["builtin", "command", "served"]
    )
    parser.add_argument(
        "--served",
        default="height=32,width=32,steps=4",
        help="the served case's fields (K=V,...): parity serve's pipeline sized to the request time wanted",
    )
    parser.add_argument("--perf-args", default="", help="more options for every `parity perf` (one string)")
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=["same", "slow"],
        default=["same", "slow"],
        help="which A/Bs per pipeline, in this order (repeats allowed): same (BASE = HEAD), slow (HEAD 10 %% slower)",
    )
    args = parser.parse_args()
    EXTRA.extend(args.perf_args.split())
    args.out.mkdir(parents=True, exist_ok=True)
    shipped = tomllib.loads((REPO / "cases" / "images" / "pipelines.toml").read_text())
    chosen = {c: {k: v for k, v in shipped["cases"][c].items() if k != "description"} for c in args.cases}
    rows = []
    for name in args.pipelines:
        runs = PIPELINES[name](args, shipped["defaults"], dict(chosen))
        for i, which in enumerate(args.runs):
            label = f"{name}_{which}" + (f"_{i}" if args.runs.count(which) > 1 else "")
            rows.append(runs[which](label))
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
    for row in rows:
        print(
            f"{row['label']:14} exit {row['exit']}  median pairs {row['median_pairs']}  {row['wall_s']:.0f} s  "
            + "  ".join(f"{case}: {dict(sorted(v.items()))}" for case, v in row["verdicts"].items())
        )
        for line in row["records"]:
            print(f"    {line}")


Runs = dict[str, Callable[[str], dict[str, object]]]  # "same" / "slow" -> run it under this label


def builtin_rows(args: argparse.Namespace, defaults: dict, chosen: dict) -> Runs:
    builtin = write_copies(args.out / "builtin", defaults, chosen, args.copies)
    slow = ("reference", "tests.targets.slow_pipeline:factory", "--head-arg", "fraction=0.1")
    return {
        "same": lambda label: perf(label, args.out, builtin, args.device, "reference", "reference"),
        "slow": lambda label: perf(label, args.out, builtin, args.device, *slow),
    }


def command_rows(args: argparse.Namespace, defaults: dict, chosen: dict) -> Runs:
    command = write_copies(args.out / "command", sleep_generator.FIELDS, {"sleepy": {}}, args.copies)
    sides = ("command", "command", "--base-arg", f"template={TEMPLATE}", "--head-arg")
    return {
        "same": lambda label: perf(label, args.out, command, args.device, *sides, f"template={TEMPLATE}"),
        "slow": lambda label: perf(label, args.out, command, args.device, *sides, f"template={TEMPLATE} --slow 0.1"),
    }


def served_rows(args: argparse.Namespace, defaults: dict, chosen: dict) -> Runs:
    """`parity serve` launched by the openai target, per side and launch: the same server, and one 10 % slower."""
    fields = {**defaults, **{k: int(v) for k, v in (kv.split("=") for kv in args.served.split(","))}}
    served = write_copies(args.out / "served", fields, {"served": {}}, args.copies)
    serve = f"{sys.executable} -m harness.cli serve --port {{port}} --device {args.device}"
    sides = ("openai", "openai", "--base-arg", f"launch={serve}", "--head-arg")
    return {
        "same": lambda label: perf(label, args.out, served, args.device, *sides, f"launch={serve}"),
        "slow": lambda label: perf(label, args.out, served, args.device, *sides, f"launch={serve} --slowdown 0.1"),
    }


PIPELINES = {"builtin": builtin_rows, "command": command_rows, "served": served_rows}


if __name__ == "__main__":
    main()
