"""The cross-stack matrix from results files of several targets (hand-made documents: the table is the subject)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.errors import ConfigError
from harness.sweep.stacks import load_stack_run


def _doc(target: str, version: str | None, records: list[dict]) -> dict:
    return {
        "command": "check",
        "target": target,
        "target_version": version,
        "device": "cpu",
        "stages": {"contracts": {"records": records}},
    }


def _rec(case: str, status: str, reason: str | None = None, **figures) -> dict:
    return {"case_id": case, "check": "usp.ulysses_parity", "status": status, "reason": reason, "figures": figures}


def test_rows_are_cases_columns_are_stacks_and_reasons_are_footnotes(tmp_path: Path, capsys) -> None:
    ref, other = tmp_path / "ref.json", tmp_path / "other.json"
    ref.write_text(
        json.dumps(
            _doc("reference", "parity 0.1.0", [_rec("u", "passed", bitwise=True), _rec("m", "passed", max_abs=0.001)])
        )
    )
    other.write_text(
        json.dumps(
            _doc(
                "stack",
                "1.2",
                [
                    _rec("u", "xfailed", "expected failure: bug 7"),
                    _rec("m", "skipped", "no masks"),
                    _rec("x", "failed", "boom", max_abs=2.0),
                ],
            )
        )
    )
    assert main(["matrix", str(ref), str(other)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| case | contract | reference parity 0.1.0 (cpu) | stack 1.2 (cpu) |"
    assert "| u | usp.ulysses_parity | pass = | xfail [1] |" in lines
    assert "| m | usp.ulysses_parity | pass 1.00e-03 | skip [2] |" in lines
    assert "| x | usp.ulysses_parity |  | FAIL 2.00e+00 [3] |" in lines
    assert lines[-3:] == ["1. expected failure: bug 7", "2. no masks", "3. boom"]


def test_sweeps_and_results_do_not_mix_and_bad_records_name_the_key(tmp_path: Path) -> None:
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps(_doc("reference", None, [_rec("u", "passed")])))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"schema": "parity.sweep/1", "platform": {}, "cells": []}))
    assert main(["matrix", str(ref), str(sweep)]) == 2
    ref.write_text(json.dumps(_doc("reference", None, [{"case_id": "u"}])))
    with pytest.raises(ConfigError) as info:
        load_stack_run(ref)
    assert info.value.key == "stages.contracts.records[0].status"


def test_a_run_with_one_backend_for_every_case_says_so_in_its_column(tmp_path: Path) -> None:
    forced, mixed = tmp_path / "fa.json", tmp_path / "mixed.json"
    records = [{**_rec(c, "passed"), "params": {"backend": "fa"}} for c in ("u", "m")]
    records.append({**_rec("encoder", "passed"), "params": {"seed": 0}})  # a case that takes no backend
    forced.write_text(json.dumps({**_doc("reference", None, records), "device": "cuda"}))
    assert load_stack_run(forced).label == "reference backend fa (cuda)"
    records[1]["params"]["backend"] = None
    mixed.write_text(json.dumps(_doc("reference", None, records)))
    assert load_stack_run(mixed).label == "reference (cpu)"
