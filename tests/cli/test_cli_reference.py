"""docs/cli-options.md is every verb's --help as scripts/cli_reference.py renders it today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docs_cli_options_is_current() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cli_reference.py")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    page = (ROOT / "docs" / "cli-options.md").read_text()
    assert page == done.stdout, "docs/cli-options.md is stale: python scripts/cli_reference.py > docs/cli-options.md"
