"""JUnit XML for CI systems: one testsuite per gate stage, one testcase per case.

Stages other than the contracts (images, timings) build :class:`JUnitCase` rows themselves
and hand them to :func:`write_junit` with the contract rows.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.contracts.verdict import FAILED, SKIPPED, Verdict


@dataclass(frozen=True)
class JUnitCase:
    suite: str
    classname: str
    name: str
    time_s: float
    status: str  # passed | failed | skipped
    message: str | None = None
    details: str | None = None


def junit_from_verdicts(verdicts: Iterable[Verdict], suite: str = "contracts") -> list[JUnitCase]:
    rows = []
    for v in verdicts:
        figures = {k: val for k, val in v.to_dict()["figures"].items() if k != "traceback"}
        details = f"bound: {v.bound}\nkernel: {v.kernel}\nfigures: {json.dumps(figures)}"
        if "traceback" in v.figures:
            details += "\n" + str(v.figures["traceback"])
        rows.append(JUnitCase(suite, v.contract_id, v.case_id, v.duration_s, v.status, v.reason, details))
    return rows


def junit_xml(cases: Sequence[JUnitCase], name: str = "parity") -> bytes:
    root = ET.Element("testsuites", name=name)
    for suite in dict.fromkeys(c.suite for c in cases):
        rows = [c for c in cases if c.suite == suite]
        element = ET.SubElement(
            root,
            "testsuite",
            name=suite,
            tests=str(len(rows)),
            failures=str(sum(c.status == FAILED for c in rows)),
            skipped=str(sum(c.status == SKIPPED for c in rows)),
            errors="0",
            time=f"{sum(c.time_s for c in rows):.3f}",
        )
        for c in rows:
            case = ET.SubElement(element, "testcase", classname=c.classname, name=c.name, time=f"{c.time_s:.3f}")
            if c.status == FAILED:
                ET.SubElement(case, "failure", message=c.message or "failed").text = c.details or ""
            elif c.status == SKIPPED:
                ET.SubElement(case, "skipped", message=c.message or "skipped")
            if c.details and c.status != FAILED:
                ET.SubElement(case, "system-out").text = c.details
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def write_junit(path: str | Path, cases: Sequence[JUnitCase], name: str = "parity") -> None:
    from harness.baselines.atomic import write_bytes_atomic

    write_bytes_atomic(path, junit_xml(cases, name))
