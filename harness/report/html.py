"""The gate's HTML report: what failed first, the evidence next, everything that passed folded away.

:func:`render_index` renders a results document with no other input, so any stage's records show.
The page reads as a person triages: a verdict banner; the failures table (each case linked to its
section, its reason and the command that shows it again), then the skips with their reasons; a
section per failing case (:func:`anchor`) with its bound, figures as formatted tables, image
metrics against thresholds and the triptych (:mod:`harness.report.triptych`) or per-frame metrics;
then every case per stage, folded, with the candidate where the gate kept it. Nothing is fetched
from the network: one self-contained file beside its PNGs, readable as a CI artifact.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.baselines.thresholds import HIGHER_IS_BETTER, meets
from harness.files.atomic import write_bytes_atomic
from harness.report.format import STATUS_COLOUR, figure
from harness.report.triptych import DIFF_MAX, PANEL_LABELS

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.2em 1.5em; color: #1f2328; }
.banner { padding: 0.6em 1em; border-radius: 6px; color: white; margin: 0 0 0.8em 0; font-size: 1.5em; }
.banner.passed { background: #1a7f37; } .banner.failed { background: #cf222e; }
table { border-collapse: collapse; margin: 0.3em 0 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #d0d7de; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
td.num { font-family: ui-monospace, monospace; text-align: right; }
code { font-size: 0.9em; }
td.text { overflow-wrap: anywhere; } td.id { white-space: nowrap; }
.status { font-weight: bold; }
.fail { color: #cf222e; font-weight: bold; } .ok { color: #1a7f37; }
article { border-top: 2px solid #cf222e; margin-top: 1em; padding-top: 0.3em; }
summary { cursor: pointer; font-weight: bold; margin: 0.4em 0; }
figure { margin: 0.5em 0 1em 0; }
img { image-rendering: pixelated; border: 1px solid #d0d7de; max-width: 100%; }
img.thumb { height: 48px; }
"""
_STAGE_ORDER_KEYS = ("target", "device", "platform", "torch", "parity_version", "host", "project")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def anchor(stage: str, case_id: str) -> str:
    """The id of a case's section: ``images-zimage_t2i_1rank`` (characters a URL fragment needs escaped become ``_``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{stage}-{case_id}")


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _text(value: Any) -> str:
    return figure(float(value)) if value in ("inf", "-inf", "nan") else figure(value)


def value_html(value: Any) -> str:
    """A figure as HTML: a formatted number or text; a list of numbers joined; a mapping or a list of
    mappings as a table (rows: keys or items; columns: their keys), recursively."""
    if _scalar(value):
        cls = " class='num'" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
        return f"<span{cls}>{_e(_text(value))}</span>"
    if isinstance(value, Mapping) and all(_scalar(v) for v in value.values()):
        return _key_value_table(value.items())
    rows: Sequence[tuple[str, Any]] = (
        list(value.items()) if isinstance(value, Mapping) else [(str(i), v) for i, v in enumerate(value)]
    )
    if all(_scalar(v) for _, v in rows):
        return _e(", ".join(_text(v) for _, v in rows)) or "-"
    if all(isinstance(v, Mapping) for _, v in rows):
        columns = list(dict.fromkeys(k for _, v in rows for k in v))
        head = "<tr><th></th>" + "".join(f"<th>{_e(c)}</th>" for c in columns) + "</tr>"
        body = "".join(
            f"<tr><th>{_e(k)}</th>" + "".join(f"<td>{value_html(v.get(c))}</td>" for c in columns) + "</tr>"
            for k, v in rows
        )
        return f"<table>{head}{body}</table>"
    return _key_value_table(rows)


def _key_value_table(items: Iterable[tuple[Any, Any]]) -> str:
    return "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{value_html(v)}</td></tr>" for k, v in items) + "</table>"


def _metrics_table(figures: Mapping[str, Any]) -> str:
    """Image metrics against their thresholds: value, bound, verdict (a skipped metric says why)."""
    thresholds: Mapping[str, Any] = figures.get("thresholds") or {}
    skipped: Mapping[str, Any] = figures.get("skipped_metrics") or {}
    rows = ["<tr><th>metric</th><th>value</th><th>bound</th><th></th></tr>"]
    for metric, bound in thresholds.items():
        value = figures.get(metric)
        op = "≥" if metric in HIGHER_IS_BETTER else "≤"
        if value is None:
            verdict = _e(skipped.get(metric, "not measured"))
        else:
            ok = meets(metric, float(value), bound)
            verdict = "<span class='ok'>ok</span>" if ok else "<span class='fail'>outside</span>"
        rows.append(
            f"<tr><th>{_e(metric)}</th><td class='num'>{_e(_text(value))}</td>"
            f"<td class='num'>{op} {_e(figure(bound))}</td><td>{verdict}</td></tr>"
        )
    return "<table>" + "".join(rows) + "</table>"


_SHOWN_ELSEWHERE = (
    "thresholds",
    "threshold_source",
    "skipped_metrics",
    "frames",
    "clip",
    "ssim",
    "psnr",
    "mean_abs_diff",
)


def _case_section(stage: str, record: Mapping[str, Any]) -> str:
    """The evidence of one failing (or undecided) case; an A/B's raw samples folded under its verdicts."""
    case_id = str(record.get("case_id", "?"))
    figures: Mapping[str, Any] = record.get("figures") or {}
    is_image = "thresholds" in figures
    parts = [
        f"<article id='{anchor(stage, case_id)}' style='overflow-wrap: anywhere'><h3>{_e(case_id)} <small>({_e(stage)}: {_e(record.get('check', ''))})</small></h3>",
        f"<p><span class='fail'>{_e(record.get('status', 'failed'))}</span>: {_e(record.get('reason') or '')}</p>",
    ]
    if record.get("next_step"):
        parts.append(f"<p>next: <code>{_e(record['next_step'])}</code></p>")
    if record.get("bound"):
        parts.append(f"<p>bound: {_e(record['bound'])}</p>")
    if is_image:
        parts.append(_metrics_table(figures))
    rest = {k: v for k, v in figures.items() if not (is_image and k in _SHOWN_ELSEWHERE) and k != "samples"}
    if rest:
        parts.append("<details open><summary>figures</summary>" + _key_value_table(rest.items()) + "</details>")
    if figures.get("samples"):
        parts.append(
            "<details><summary>every run (ms, in pair order)</summary>" + value_html(figures["samples"]) + "</details>"
        )
    artifacts: Mapping[str, Any] = record.get("artifacts") or {}
    if artifacts.get("triptych"):
        caption = (
            f"{' | '.join(PANEL_LABELS)}: |diff| is the mean over RGB in levels of 255, black 0, white "
            f"{DIFF_MAX:g} or more (square-root scale, the same in every case)"
        )
        parts.append(
            f"<figure><img src='{_e(artifacts['triptych'])}' alt='{_e(case_id)}: {' | '.join(PANEL_LABELS)}'>"
            f"<figcaption>{_e(caption)}</figcaption></figure>"
        )
    if figures.get("frames"):
        parts.append("<p>per frame:</p>" + value_html(figures["frames"]))
    if artifacts.get("candidate"):
        parts.append(f"<p>candidate saved: <a href='{_e(artifacts['candidate'])}'>{_e(artifacts['candidate'])}</a></p>")
    if record.get("traceback"):
        parts.append(f"<details><summary>traceback</summary><pre>{_e(record['traceback'])}</pre></details>")
    return "".join(parts) + "</article>"


def _brief_figures(figures: Mapping[str, Any], limit: int = 4) -> str:
    shown = [(k, v) for k, v in figures.items() if _scalar(v) and k not in ("thresholds", "threshold_source")][:limit]
    return ", ".join(f"{k} {_text(v)}" for k, v in shown)


def _stage_details(name: str, stage: Mapping[str, Any]) -> str:
    if "skipped" in stage:
        return f"<p><b>{_e(name)}</b>: skipped ({_e(stage['skipped'])})</p>"
    summary = ", ".join(f"{v} {k}" for k, v in (stage.get("summary") or {}).items() if v)
    wall = stage.get("wall_s")
    rows = ["<tr><th>case</th><th>status</th><th>bound / reason</th><th>figures</th><th>ms</th><th>output</th></tr>"]
    for r in stage.get("records", []):
        status = str(r.get("status", ""))
        case_id = str(r.get("case_id", "?"))
        name_html = f"<a href='#{anchor(name, case_id)}'>{_e(case_id)}</a>" if status in _LOOK_AT else _e(case_id)
        candidate = (r.get("artifacts") or {}).get("candidate")
        output = (
            f"<a href='{_e(candidate)}'><img class='thumb' src='{_e(candidate)}' alt='{_e(case_id)} candidate'></a>"
            if candidate
            else ""
        )
        duration = r.get("duration_s")
        rows.append(
            f"<tr><td>{name_html}</td><td class='status' style='color:{STATUS_COLOUR.get(status, '#1f2328')}'>{_e(status)}</td>"
            f"<td>{_e(r.get('reason') or r.get('bound') or '')}</td><td>{_e(_brief_figures(r.get('figures') or {}))}</td>"
            f"<td class='num'>{'' if duration is None else f'{duration * 1000:.0f}'}</td><td>{output}</td></tr>"
        )
    timing = f" in {wall:.1f} s" if isinstance(wall, (int, float)) else ""
    return f"<details><summary>{_e(name)}: {_e(summary or 'no cases')}{timing}</summary><table>{''.join(rows)}</table></details>"


_LOOK_AT = ("failed", "inconclusive")  # the records a reader must look at: listed first, each with its section


def _records(document: Mapping[str, Any], status: str) -> list[tuple[str, Mapping[str, Any]]]:
    return [
        (name, r)
        for name, stage in (document.get("stages") or {}).items()
        for r in stage.get("records", [])
        if r.get("status") == status
    ]


def _first_line(text: str | None, limit: int = 240) -> str:
    line = (text or "").splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _failure_tables(document: Mapping[str, Any]) -> str:
    parts = []
    for status, title, table_id in (
        ("failed", "Failures", "failures"),
        ("inconclusive", "Inconclusive", "inconclusive"),
    ):
        records = _records(document, status)
        if not records:
            continue
        rows = ["<tr><th>stage</th><th>case</th><th>check</th><th>reason</th><th>next step</th></tr>"]
        rows += [
            f"<tr><td class='id'>{_e(s)}</td><td class='id'><a href='#{anchor(s, str(r.get('case_id')))}'>{_e(r.get('case_id'))}</a></td>"
            f"<td class='id'>{_e(r.get('check', ''))}</td><td class='text'>{_e(_first_line(r.get('reason')))}</td>"
            f"<td class='text'>{'<code>' + _e(r['next_step']) + '</code>' if r.get('next_step') else ''}</td></tr>"
            for s, r in records
        ]
        parts.append(f"<h2>{title} ({len(records)})</h2><table id='{table_id}'>{''.join(rows)}</table>")
    return "".join(parts)


def _skip_table(document: Mapping[str, Any]) -> str:
    """The skipped and expected-failure cases, after the failing ones (a long list must not push them down)."""
    parts = []
    skipped = _records(document, "skipped") + _records(document, "xfailed") + _records(document, "not_applicable")
    stage_skips = [(n, s["skipped"]) for n, s in (document.get("stages") or {}).items() if "skipped" in s]
    if skipped or stage_skips:
        rows = ["<tr><th>stage</th><th>case</th><th>status</th><th>reason</th></tr>"]
        rows += [
            f"<tr><td class='id'>{_e(n)}</td><td class='id'>(whole stage)</td><td class='id'>skipped</td>"
            f"<td class='text'>{_e(reason)}</td></tr>"
            for n, reason in stage_skips
        ]
        rows += [
            f"<tr><td class='id'>{_e(s)}</td><td class='id'>{_e(r.get('case_id'))}</td><td class='id'>{_e(r.get('status'))}</td>"
            f"<td class='text'>{_e(_first_line(r.get('reason')))}</td></tr>"
            for s, r in skipped
        ]
        parts.append(f"<h2>Skipped ({len(skipped) + len(stage_skips)})</h2><table id='skips'>{''.join(rows)}</table>")
    return "".join(parts)


def _banner(document: Mapping[str, Any]) -> str:
    passed = bool(document.get("passed"))
    failed = _records(document, "failed")
    by_stage: dict[str, int] = {}
    for stage, _ in failed:
        by_stage[stage] = by_stage.get(stage, 0) + 1
    detail = ", ".join(f"{n} in {s}" for s, n in by_stage.items())
    undecided = _records(document, "inconclusive")
    if passed:
        verdict = "PASSED" + (f" ({len(undecided)} inconclusive, counted as passed)" if undecided else "")
    elif failed:
        verdict = f"FAILED: {len(failed)} failing case{'s' if len(failed) != 1 else ''}" + (
            f" ({detail})" if detail else ""
        )
    else:
        verdict = f"INCONCLUSIVE: {len(undecided)} undecided case{'s' if len(undecided) != 1 else ''}"
    env = [f"{k} {document[k]}" for k in _STAGE_ORDER_KEYS if document.get(k) is not None]
    git = document.get("git") or {}
    if git.get("commit"):
        env.append(f"commit {str(git['commit'])[:12]}{' (dirty)' if git.get('dirty') else ''}")
    wall = document.get("wall_s")
    if isinstance(wall, (int, float)) and math.isfinite(wall):
        env.append(f"{wall:.1f} s")
    return (
        f"<div id='verdict' class='banner {'passed' if passed else 'failed'}'>parity {_e(document.get('command', 'gate'))}: "
        f"{_e(verdict)}</div><p>{_e('; '.join(env))}</p>"
    )


def render_index(document: Mapping[str, Any]) -> str:
    """The report page for a results document."""
    look_at = [(s, r) for status in _LOOK_AT for s, r in _records(document, status)]
    pictured = [(s, r) for s, r in look_at if (r.get("artifacts") or {}).get("triptych")]  # image failures first
    failing = "".join(_case_section(s, r) for s, r in pictured + [x for x in look_at if x not in pictured])
    stages = "".join(_stage_details(n, s) for n, s in (document.get("stages") or {}).items())
    body = (
        _banner(document)
        + _failure_tables(document)
        + (f"<h2>Failing cases</h2>{failing}" if failing else "")
        + _skip_table(document)
        + f"<h2>Every case, by stage</h2>{stages}"
    )
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>parity report</title>"
        f"<style>{_CSS}</style></head><body>\n{body}\n</body></html>\n"
    )


def write_index(path: str | Path, document: Mapping[str, Any]) -> None:
    """Write :func:`render_index` atomically."""
    write_bytes_atomic(path, render_index(document).encode("utf-8"))
