"""A case needing a capability the target does not declare is *not applicable*: counted and shown, never a pass
and never a failure, for a target no overlay speaks for; a target whose overlay says what it runs must still pin
such a skip (a capability it dropped is a change)."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.cli import main
from harness.contracts.case import ExpectedSkip, make_case
from harness.contracts.runner import RunOptions, run_cases
from harness.ranks import PoolSet
from harness.results import FAILED, NOT_APPLICABLE, PASSED, SKIPPED
from harness.targets.spec import TargetSpec

pytestmark = pytest.mark.timeout(600)

NARROW = "tests.targets.narrow:factory"


def test_a_narrow_correct_target_passes_the_default_cases_with_the_rest_not_applicable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["check", "--target", NARROW, "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")])
    out = capsys.readouterr().out
    records = json.loads((tmp_path / "r.json").read_text())["stages"]["contracts"]["records"]
    by_status: dict[str, list[dict]] = {}
    for r in records:
        by_status.setdefault(r["status"], []).append(r)
    assert code == 0, out[-3000:]
    assert set(by_status) <= {"passed", "not_applicable", "skipped"}, {s: len(v) for s, v in by_status.items()}
    assert len(by_status["passed"]) >= 10 and len(by_status["not_applicable"]) >= 50
    assert all(
        r["reason"].startswith("target ") and " does not support " in r["reason"] for r in by_status["not_applicable"]
    )
    assert {r["case_id"] for r in by_status["passed"]} >= {"ulysses[world_size=2,dtype=fp32,causal=false]"}
    assert f"{len(by_status['not_applicable'])} not applicable" in out and out.rstrip().endswith("check: PASSED")
    junit = ET.parse(tmp_path / "r.xml").findall(".//testcase/skipped")
    assert sum((s.get("message") or "").startswith("not applicable: ") for s in junit) == len(
        by_status["not_applicable"]
    )


def test_only_not_applicable_cases_is_a_run_that_checked_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["check", "ring_gqa", "--target", NARROW])
    assert code == 2
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith("check: NOTHING RAN (1 case, every one skipped or not applicable: nothing was checked; exit 2)")
    )


RING = make_case("usp.ring_parity", {"world_size": 2}, case_id="ring_w2", source="test")


@pytest.mark.parametrize(
    ("overlay", "expected_skip", "status"),
    [(None, False, NOT_APPLICABLE), ("stack.toml", False, FAILED), ("stack.toml", True, SKIPPED)],
    ids=["no-overlay", "overlay-unpinned", "overlay-pinned"],
)
def test_an_undeclared_capability_is_not_applicable_unless_an_overlay_says_what_the_target_runs(
    rank_pools: PoolSet, overlay: str | None, expected_skip: bool, status: str
) -> None:
    pin = ExpectedSkip("no ring here", "stack.toml: expected_skips.ring_w2", "does not support ring")
    case = dataclasses.replace(RING, target_overlay=overlay, expected_skip=pin if expected_skip else None)
    [result] = run_cases([case], RunOptions(TargetSpec(NARROW)), rank_pools)
    assert result.status == status, result.reason
    assert "does not support ring" in (result.reason or "")
    [ran] = run_cases(
        [make_case("usp.ulysses_parity", {"world_size": 2}, case_id="u", source="test")],
        RunOptions(TargetSpec(NARROW)),
        rank_pools,
    )
    assert ran.status == PASSED, ran.reason
