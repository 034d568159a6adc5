"""The report of a failing gate, opened in a real browser (Debian's headless Chromium): the failure comes first.

The document has the shape the issue was found with: 93 passing contract cases (with nested
figures), one skipped, and one failing image case with its triptych. It is built from real
CaseResults through the one results writer, rendered by the one HTML renderer, loaded in a
1280x800 window; the checks are on the DOM (positions and document order), the screenshot is
kept for a person to look at.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness.baselines.thresholds import ThresholdSet
from harness.cases.image import ImageCase
from harness.gate.images import judge_case
from harness.paths import default_baselines_dir
from harness.report.html import anchor, write_index
from harness.report.triptych import triptych, write_png
from harness.results import FAILED, PASSED, SKIPPED, CaseResult, StageResult, results_document
from tests.report.webdriver import chromium, find_browser

BROWSER = find_browser()
pytestmark = [
    pytest.mark.skipif(
        BROWSER is None,
        reason="needs Debian's chromium and chromium-driver (apt-get install chromium "
        "chromium-driver; .ci/run installs them)",
    ),
    pytest.mark.timeout(180),
]
VIEWPORT = (1280, 800)


def _failing_report(directory: Path) -> str:
    contracts = [
        CaseResult(
            f"ulysses_case_{i:02d}[dtype=bf16,causal=false,heads=30]",
            "usp.ulysses_parity",
            PASSED,
            figures={
                "bitwise": True,
                "max_abs": 0.0,
                "mean_abs": 0.0,
                "rel_err": 0.0,
                "paths": {
                    "block.image": {"bitwise": True, "max_abs": 0.0, "numel": 4096},
                    "dit": {"bitwise": True, "max_abs": 1.07e-06, "numel": 384},
                },
            },
            bound="bitwise (torch.equal with the single-rank reference)",
            kernel="torch_sdpa",
            duration_s=0.012,
            params={"world_size": 2},
        )
        for i in range(93)
    ]
    contracts.append(
        CaseResult(
            "ring_admission",
            "usp.ring_admission",
            SKIPPED,
            "backend sage_attn is not installed",
            params={"world_size": 2},
        )
    )
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    cand = ref.copy()
    cand[8:24, 8:24] //= 2
    case = ImageCase("zimage_t2i_1rank", "image", 1, 1, 1, {"prompt": "a fox", "seed": 1}, source="test")
    bounds = ThresholdSet.load(default_baselines_dir() / "consistency_threshold.json").for_case(case.id, "image")
    failing = judge_case(case, ref, cand, bounds, None, "no CLIP model configured")
    write_png(directory / "triptychs" / f"{case.id}.png", triptych(ref, cand).picture)
    failing.artifacts["triptych"] = f"triptychs/{case.id}.png"
    failing.next_step = f"see index.html#{anchor('images', case.id)}"
    document = results_document(
        "gate",
        {"device": "cpu"},
        {
            "contracts": StageResult("contracts", contracts, 40.5),
            "images": StageResult("images", [failing], 1.2),
            "perf": "no perf baseline for hardware 'cpu_x86_64'",
        },
        42.0,
    )
    write_index(directory / "index.html", document)
    return anchor("images", case.id)


GEOMETRY = """
const table = document.querySelector('table');
const row = document.querySelector('#failures a[href="#' + arguments[0] + '"]');
const section = document.getElementById(row.getAttribute('href').slice(1));
const passing = Array.from(document.querySelectorAll('details td')).find(td => td.textContent.startsWith('ulysses_case_00'));
const r = row.getBoundingClientRect();
return {first_table: table.id, row_top: r.top, row_bottom: r.bottom, viewport: window.innerHeight,
        section_top: section.getBoundingClientRect().top,
        section_before_passing: !!(section.compareDocumentPosition(passing) & Node.DOCUMENT_POSITION_FOLLOWING),
        passing_shown: passing.checkVisibility(), page_height: document.documentElement.scrollHeight,
        triptych_loaded: Array.from(section.querySelectorAll('img')).every(img => img.complete && img.naturalWidth > 0)};
"""


def test_the_first_failing_case_is_in_the_first_screenful(tmp_path: Path) -> None:
    assert BROWSER is not None
    report = tmp_path / "report"
    target = _failing_report(report)
    with chromium(*BROWSER, tmp_path / "profile", *VIEWPORT) as browser:
        browser.open((report / "index.html").as_uri())
        geometry = browser.script(GEOMETRY, target)
        browser.screenshot(tmp_path / "report.png")
    print(f"report in {VIEWPORT[0]}x{VIEWPORT[1]}: {geometry}; screenshot {tmp_path / 'report.png'}")
    assert geometry["first_table"] == "failures"  # the failures table is the first table of the page
    assert 0 <= geometry["row_top"] and geometry["row_bottom"] <= geometry["viewport"]  # visible without scrolling
    assert geometry["section_before_passing"] and not geometry["passing_shown"]  # passing cases come after, folded
    assert geometry["triptych_loaded"]
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


MANY_FAILURES = """
const link = document.querySelector('#failures a[href="#' + arguments[0] + '"]');
const section = document.getElementById(arguments[0]);
const img = section.querySelector('img');
const before = section.getBoundingClientRect().top + window.scrollY;
link.click();
return {rows: document.querySelectorAll('#failures tr').length - 1, viewport: window.innerHeight, section_at: before,
        after_click: section.getBoundingClientRect().top, triptych_loaded: img.complete && img.naturalWidth > 0,
        every_row_links: Array.from(document.querySelectorAll('#failures tr')).slice(1)
            .every(tr => { const a = tr.querySelector('a'); return a && document.getElementById(a.getAttribute('href').slice(1)); })};
"""


def test_with_28_failures_the_image_triptych_is_one_link_and_3_screenfuls_away(tmp_path: Path) -> None:
    """27 failing contract cases, 91 skips and one failing image case: its triptych follows the failures table."""
    assert BROWSER is not None
    report = tmp_path / "report"
    target = anchor("images", "zimage_t2i_1rank")
    rng = np.random.default_rng(1)
    ref = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    cand = ref.copy()
    cand[4:20, 4:20] //= 3
    case = ImageCase("zimage_t2i_1rank", "image", 1, 1, 1, {"prompt": "a fox", "seed": 1}, source="test")
    bounds = ThresholdSet.load(default_baselines_dir() / "consistency_threshold.json").for_case(case.id, "image")
    image = judge_case(case, ref, cand, bounds, None, "no CLIP model configured")
    write_png(report / "triptychs" / f"{case.id}.png", triptych(ref, cand).picture)
    image.artifacts["triptych"] = f"triptychs/{case.id}.png"
    contracts = [
        CaseResult(
            f"ring_case_{i:02d}[dtype=bf16,causal=true]",
            "usp.ring_parity",
            FAILED,
            "max_abs 0.0312 > bound 0.0156 (|out - ref64| <= 2 x |naive_bf16 - ref64| + 1e-05)",
            figures={"bitwise": False, "max_abs": 0.0312, "paths": {"out": {"max_abs": 0.0312}}},
            traceback="Traceback (most recent call last):\n" + "  frame\n" * 30,
            params={"world_size": 2},
        )
        for i in range(27)
    ]
    contracts += [
        CaseResult(
            f"skipped_{i:02d}",
            "usp.ring_parity",
            SKIPPED,
            "backend fa is not installed: flash-attn",
            params={"world_size": 2},
        )
        for i in range(91)
    ]
    write_index(
        report / "index.html",
        results_document(
            "gate",
            {"device": "cpu"},
            {"contracts": StageResult("contracts", contracts, 40.5), "images": StageResult("images", [image], 1.2)},
            42.0,
        ),
    )
    with chromium(*BROWSER, tmp_path / "profile", *VIEWPORT) as browser:
        browser.open((report / "index.html").as_uri())
        geometry = browser.script(MANY_FAILURES, target)
        browser.screenshot(tmp_path / "many.png")
    print(f"28 failures in {VIEWPORT[0]}x{VIEWPORT[1]}: {geometry}")
    assert geometry["rows"] == 28 and geometry["every_row_links"] and geometry["triptych_loaded"]
    assert geometry["section_at"] < 3 * geometry["viewport"]  # within the first 3 screenfuls
    assert abs(geometry["after_click"]) < 2  # the link scrolls it to the top
