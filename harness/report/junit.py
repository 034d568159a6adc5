"""JUnit XML for CI systems: one testsuite per stage, one testcase per case result.

An expected failure (a known upstream divergence that failed as recorded) is reported as
skipped with its reason, as pytest reports an xfail; so is a case not applicable to the target. An
inconclusive timing is a failure of type ``inconclusive`` where it counts against the run (the
default), else skipped with its reason.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path

from harness.results import FAILED, INCONCLUSIVE, NOT_APPLICABLE, SKIPPED, XFAILED, CaseResult, json_safe

_SKIPS = (SKIPPED, XFAILED, INCONCLUSIVE, NOT_APPLICABLE)


def _details(result: CaseResult) -> str:
    text = f"bound: {result.bound}\nkernel: {result.kernel}\nfigures: {json.dumps(json_safe(result.figures), sort_keys=True)}"
    return text + (f"\n{result.traceback}" if result.traceback else "")


def junit_xml(
    stages: Mapping[str, Sequence[CaseResult]], name: str = "parity", inconclusive_fails: bool = True
) -> bytes:
    failing = (FAILED, INCONCLUSIVE) if inconclusive_fails else (FAILED,)
    root = ET.Element("testsuites", name=name)
    for suite, results in stages.items():
        element = ET.SubElement(
            root,
            "testsuite",
            name=suite,
            tests=str(len(results)),
            failures=str(sum(r.status in failing for r in results)),
            skipped=str(sum(r.status not in failing and r.status in _SKIPS for r in results)),
            errors="0",
            time=f"{sum(r.duration_s for r in results):.3f}",
        )
        for r in results:
            case = ET.SubElement(element, "testcase", classname=r.check, name=r.case_id, time=f"{r.duration_s:.3f}")
            details = _details(r)
            if r.status in failing:
                ET.SubElement(case, "failure", message=r.reason or str(r.status), type=str(r.status)).text = details
            elif r.status in _SKIPS:
                prefix = {
                    XFAILED: "expected failure: ",
                    INCONCLUSIVE: "inconclusive: ",
                    NOT_APPLICABLE: "not applicable: ",
                }
                prefix = prefix.get(r.status, "")
                ET.SubElement(case, "skipped", message=prefix + (r.reason or "skipped"))
            if r.status not in failing:
                ET.SubElement(case, "system-out").text = details
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def write_junit(
    path: str | Path, stages: Mapping[str, Sequence[CaseResult]], name: str = "parity", inconclusive_fails: bool = True
) -> None:
    from harness.files.atomic import write_bytes_atomic

    write_bytes_atomic(path, junit_xml(stages, name, inconclusive_fails))
