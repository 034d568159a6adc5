"""The long suite on every commit: 12,288 tokens at W = 2 (Ulysses, ring; Ulysses and ring gradients at 8,192)
through the oracles' and the MATH kernel's O(S) paths, passing with the whole check (every process together)
below 4 GB. With whole S×S float64 oracles Ulysses, ring and Ulysses gradients at 12,288 held 13.3 GiB."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.process_memory import GIB, run_measured

pytestmark = pytest.mark.timeout(900)
LIMIT_BYTES = 4 * 10**9


@pytest.mark.slow
def test_the_long_suite_passes_in_bounded_memory(tmp_path: Path) -> None:
    report = tmp_path / "long.json"
    command = [sys.executable, "-m", "harness.cli", "check", "--suite", "long", "--json", str(report), "-q"]
    with open(tmp_path / "out.txt", "w") as out:
        code, peaks = run_measured(command, stdout=out)
    records = json.loads(report.read_text())["stages"]["contracts"]["records"]
    assert (code, sorted((r["case_id"], r["status"]) for r in records)) == (
        0,
        [
            ("long_ring", "passed"),
            ("long_ring_grad", "passed"),
            ("long_ulysses", "passed"),
            ("long_ulysses_grad", "passed"),
        ],
    ), (tmp_path / "out.txt").read_text()
    assert {r["params"]["tokens"] for r in records} == {12288, 8192}
    assert peaks.pss < LIMIT_BYTES, f"the check held {peaks.pss / GIB:.2f} GiB (PSS, every process together)"
