"""The cross-stack matrix: the same contract cases judged on several targets, one column per stack.

Input: results documents of ``parity check --json`` (or ``parity gate --json``), one per target
run (the reference, sglang, diffusers, yunchang...). Rows are contract cases, columns are
``<target> <version> (<device>)``; a cell reads ``pass``, ``FAIL``, ``xfail`` (a recorded
upstream divergence) or ``skip``, with its figure: ``=`` bitwise with one rank, else the max abs
error, and for a failure or a skip its reason in a footnote, so the table says *why* a stack
differs, not only that it does.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import ConfigError
from harness.files.jsonio import expect_object, read_json
from harness.report.format import outcome_cell
from harness.results import stage_records


@dataclass(frozen=True)
class StackRun:
    """One target's results on the contract cases."""

    path: str
    label: str
    records: dict[str, dict[str, Any]]  # case id -> record


def is_results_document(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("stages"), dict) and "command" in data


def load_stack_run(path: str | Path) -> StackRun:
    """A results document's contract records, labelled by target, version and device."""
    data = expect_object(read_json(path), path, "")
    if not is_results_document(data):
        raise ConfigError(
            "not a parity results document (written by `parity check --json` or `gate --json`)", path=path
        )
    expect_object(data["stages"].get("contracts"), path, "stages.contracts")
    records = {case_id: r.record for (stage, case_id), r in stage_records(data, path).items() if stage == "contracts"}
    version = data.get("target_version")
    label = f"{data.get('target', '?')}{f' {version}' if version else ''}{_forced_backend(records)} ({data.get('device', '?')})"
    return StackRun(str(path), label, records)


def _forced_backend(records: dict[str, dict[str, Any]]) -> str:
    """`` backend fa`` where every case ran one backend (``check --backend``): a column of its own, said so."""
    params = [r.get("params") or {} for r in records.values()]
    backends = {str(p["backend"]) for p in params if "backend" in p}  # cases that take no backend say nothing
    return f" backend {backends.pop()}" if len(backends) == 1 and "None" not in backends else ""


def _cell(record: dict[str, Any] | None, notes: dict[str, int]) -> str:
    if record is None:
        return ""
    text = outcome_cell(record["status"], record.get("figures"))
    reason = record.get("reason")
    if reason and record["status"] != "passed":
        note = notes.setdefault(reason, len(notes) + 1)
        text += f" [{note}]"
    return text


def build(runs: Sequence[StackRun]) -> tuple[list[str], list[list[str]], dict[str, int]]:
    """Rows (case id and its contract), cells per run, and the footnotes (reason -> number)."""
    cases: dict[str, str] = {}
    for run in runs:
        for case_id, record in run.records.items():
            cases.setdefault(case_id, str(record.get("check", "")))
    notes: dict[str, int] = {}
    rows = [
        [case_id, contract, *(_cell(run.records.get(case_id), notes) for run in runs)]
        for case_id, contract in cases.items()
    ]
    return [run.label for run in runs], rows, notes


def render_markdown(runs: Sequence[StackRun]) -> str:
    labels, rows, notes = build(runs)
    lines = ["| case | contract | " + " | ".join(labels) + " |", "| --- | --- |" + " --- |" * len(labels)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    lines += [
        "",
        "`=` bitwise with one rank; a number is the max abs error against one rank; `xfail`: a known upstream "
        "divergence recorded in `cases/contracts/targets/<target>.toml` that failed as recorded.",
        "",
    ]
    lines += [f"{n}. {reason}" for reason, n in notes.items()]
    return "\n".join(lines) + "\n"


def render_html(runs: Sequence[StackRun]) -> str:
    labels, rows, notes = build(runs)
    esc = html.escape

    def css(text: str) -> str:
        return {"FAIL": "fail", "pass": "pass", "xfail": "xfail"}.get(text.split(" ", 1)[0], "skip")

    head = "".join(f"<th>{esc(label)}</th>" for label in labels)
    body = "".join(
        f"<tr><th>{esc(row[0])}</th><td>{esc(row[1])}</td>"
        + "".join(f'<td class="{css(c)}">{esc(c)}</td>' for c in row[2:])
        + "</tr>"
        for row in rows
    )
    notes_html = "".join(f"<li value='{n}'>{esc(reason)}</li>" for reason, n in notes.items())
    return (
        "<!doctype html><meta charset='utf-8'><title>parity: cross-stack matrix</title>"
        "<style>td,th{border:1px solid #ccc;padding:4px;font:13px monospace}"
        ".pass{background:#dfd}.fail{background:#fcc}.xfail{background:#fec}.skip{background:#eee}</style>"
        f"<table><tr><th>case</th><th>contract</th>{head}</tr>{body}</table><ol>{notes_html}</ol>"
    )
