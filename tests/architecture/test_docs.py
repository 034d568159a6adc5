"""The README stays short, every relative link of the README and docs/ resolves, and every module's
docstring says what and why in at most 10 lines (the history belongs in commit messages)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 250
MAX_DOCSTRING_LINES = 10
PAGES = [README, ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

SOURCE_DIRS = ("harness", "reference_impl", "benchmarks", "scripts", "parity")
MODULES = sorted(str(p.relative_to(ROOT)) for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def test_readme_is_at_most_250_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move the detail into a docs/ page"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    targets = [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:|#", t)]
    broken = [t for t in targets if not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


@pytest.mark.parametrize("module", MODULES)
def test_module_docstring_is_at_most_10_lines(module: str) -> None:
    doc = ast.get_docstring(ast.parse((ROOT / module).read_text())) or ""
    lines = len(doc.splitlines())
    assert lines <= MAX_DOCSTRING_LINES, (
        f"{module}: a {lines}-line docstring; say what and why, history goes to commits"
    )
