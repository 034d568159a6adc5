"""Every pin of every recorded release holds to what that release did: each overlay entry, applied at the
release's version, names only cases the release failed as expected or skipped for the pinned reason.

The results are the committed `parity check --json` runs of docs/targets/versions/ (docs/targets/versions.md
says how they were made). A pin whose glob also matches a case that passes (sglang 0.5.17's
``skip_sequence_parallel_local[*`` matched the Ulysses cases), or a case of the default set the run did not
record, fails here without installing any release.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.version import Version

from harness.cases import load_cases
from harness.cases.overlays import apply_target_overlay
from harness.files.jsonio import read_json
from harness.paths import default_cases_dir
from harness.targets.base import Refusal, Refused

RUNS = sorted((Path(__file__).resolve().parents[2] / "docs" / "targets" / "versions").glob("*.json"))


def test_each_stack_has_recorded_releases() -> None:
    """The grid below is not empty: a missing results directory would otherwise check nothing, silently."""
    assert {read_json(p)["target"] for p in RUNS} == {"sglang", "diffusers", "yunchang", "yunchang-ulysses"}


def _refused(record: dict) -> Refused | None:
    """A skip's typed cause: recorded, or for a run recorded before results carried it, read from the words
    parity's own refusals put in its reason (the capabilities a target lacks)."""
    if record.get("refusal"):
        return Refused(Refusal(record["refusal"]["kind"]), frozenset(record["refusal"]["lacks"]))
    lacking = re.search(r"does not (?:support ([a-z_, ]+) \(|declare ([a-z_]+)\b)", record["reason"] or "")
    return Refused(Refusal.LACKS, frozenset((lacking[1] or lacking[2]).split(", "))) if lacking else None


@pytest.mark.parametrize("path", RUNS, ids=[p.stem for p in RUNS])
def test_every_pin_of_a_recorded_release_holds_to_what_it_did(path: Path) -> None:
    run = read_json(path)
    overlay = default_cases_dir() / "contracts" / "targets" / f"{run['target']}.toml"
    cases = apply_target_overlay(
        load_cases(default_cases_dir(), run["platform"]), overlay, Version(run["target_version"]), run["platform"]
    )
    recorded = {r["case_id"]: r for r in run["stages"]["contracts"]["records"]}
    assert sorted({c.id for c in cases} - set(recorded)) == [], f"not in {path.name}: run the release again"
    wrong = {}
    for case in cases:
        status, reason = recorded[case.id]["status"], recorded[case.id]["reason"] or ""
        if case.expected_failure is not None and status != "xfailed":
            wrong[case.id] = f"pinned to fail ({case.expected_failure.where}) but {status}: {reason}"
        pin = case.expected_skip
        missed = pin.mismatch(_refused(recorded[case.id]), reason) if pin is not None else None
        if status == "skipped" and missed is not None:
            wrong[case.id] = f"pinned to skip for {missed} ({pin.where}) but skipped for: {reason}"
        if status == "failed":
            wrong[case.id] = f"failed: {reason}"
    assert wrong == {}
