"""Hostile results files through ``parity compare``: 0 tracebacks, 0 wrong accepts, escapes rendered inert.

The base file is a passing run; each row edits the new one (a figure that became ``"nan"``, went
missing or null, became a word; a case recorded twice; a case gone; control characters in ids) and
says what ``compare`` must answer: the exit code and what its output must say. A figure that
cannot be shown to be within bounds fails every ``--fail-on`` naming it; a file that cannot be
compared is refused (exit 2) naming the file and the key.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main

BASE: dict[str, Any] = {
    "command": "check",
    "passed": True,
    "git": {"commit": "abc", "dirty": False},
    "stages": {
        "contracts": {
            "records": [
                {
                    "case_id": "c1",
                    "check": "usp.x",
                    "status": "passed",
                    "figures": {"bitwise": False, "max_abs": 1e-3, "kernel": "sdpa"},
                },
                {"case_id": "c2", "check": "usp.x", "status": "passed", "figures": {"max_abs": 2e-3}},
            ]
        }
    },
}


def _records(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["stages"]["contracts"]["records"]


def _figure(case: int, name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        _records(doc)[case]["figures"][name] = value

    return edit


def _drop_figure(doc: dict[str, Any]) -> None:
    del _records(doc)[0]["figures"]["max_abs"]


def _drop_case(doc: dict[str, Any]) -> None:
    del _records(doc)[1]


def _duplicate(doc: dict[str, Any]) -> None:
    _records(doc).append(copy.deepcopy(_records(doc)[0]))


def _hide_a_worse_record(doc: dict[str, Any]) -> None:
    worse = copy.deepcopy(_records(doc)[0])
    worse["figures"]["max_abs"] = 0.5
    _records(doc).insert(0, worse)  # a later, better record of the same case would win a dict


def _escape_in(field: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        if field == "case_id":
            _records(doc)[0]["case_id"] = "c1\x1b]0;pwned\x07\x1b[2J"
        elif field == "figure":
            _records(doc)[0]["figures"]["\x1b[31mmax_abs"] = 5.0
        else:
            doc["git"]["commit"] = "\x1b[2Jabc"

    return edit


# (id, edit of the new file, --fail-on rules, exit code, what the output must hold[, edit of the base file])
ROWS = [
    ("unchanged", lambda d: None, ["max_abs:0"], 0, "0 past a --fail-on threshold"),
    ("became_nan", _figure(0, "max_abs", "nan"), ["max_abs:1000"], 1, "FAIL contracts/c1 max_abs: 0.001 -> nan"),
    ("became_inf", _figure(0, "max_abs", "inf"), ["max_abs:1000"], 1, "FAIL contracts/c1 max_abs: 0.001 -> inf"),
    ("went_missing", _drop_figure, ["max_abs:1000"], 1, "FAIL contracts/c1 max_abs: 0.001 -> missing"),
    ("became_null", _figure(0, "max_abs", None), ["max_abs:1000"], 1, "FAIL contracts/c1 max_abs: 0.001 -> missing"),
    ("case_gone", _drop_case, ["max_abs:1000"], 1, "FAIL contracts/c2 max_abs: 0.002 -> missing"),
    ("became_a_word", _figure(0, "max_abs", "small"), [], 2, "key 'stages.contracts.records[0].figures.max_abs'"),
    ("became_a_boolean", _figure(0, "max_abs", True), [], 2, "key 'stages.contracts.records[0].figures.max_abs'"),
    ("became_a_table", _figure(0, "max_abs", {"x": 1}), [], 2, "key 'stages.contracts.records[0].figures.max_abs'"),
    ("duplicate_record", _duplicate, [], 2, "key 'stages.contracts.records[2].case_id': a second record of case 'c1'"),
    ("duplicate_hides_a_worse_one", _hide_a_worse_record, ["max_abs:1000"], 2, "a second record of case 'c1'"),
    ("word_figure_on_both_sides_kept", _figure(0, "kernel", "flash"), [], 0, "figures compared"),
    (
        "improved_from_nan",
        lambda d: None,
        ["max_abs:0"],
        0,
        "0 past a --fail-on threshold",
        _figure(0, "max_abs", "nan"),
    ),
    ("escape_in_a_case_id", _escape_in("case_id"), [], 0, "c1\\x1b]0;pwned\\x07\\x1b[2J"),
    ("escape_in_a_figure_name", _escape_in("figure"), [], 0, "\\x1b[31mmax_abs"),
    ("escape_in_the_commit", _escape_in("commit"), [], 0, "\\x1b[2Jabc"),
    (
        "misspelt_record_key",
        lambda d: _records(d)[0].update(figure=_records(d)[0].pop("figures")),
        [],
        2,
        "key 'stages.contracts.records[0].figure': unknown key: did you mean 'figures'?",
    ),
    (
        "misspelt_top_level_key",
        lambda d: d.update(stagse={}),
        [],
        2,
        "key 'stagse': unknown key: did you mean 'stages'?",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_compare_of_a_hostile_results_file(
    row: tuple[Any, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, edit, rules, code, says, *base_edit = row
    base_doc, new_doc = copy.deepcopy(BASE), copy.deepcopy(BASE)
    for change in base_edit:
        change(base_doc)
    edit(new_doc)
    base, new = tmp_path / "base.json", tmp_path / "new.json"
    base.write_text(json.dumps(base_doc))
    new.write_text(json.dumps(new_doc))
    args = ["compare", str(base), str(new), "--all"] + [f"--fail-on={rule}" for rule in rules]
    assert main(args) == code
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert says in text, text
    assert "\x1b" not in text and "\x07" not in text  # nothing a terminal would act on
    if code == 2:
        assert str(new) in captured.err
