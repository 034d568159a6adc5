"""Rank groups start from a preloaded process (issue 19): a heavy target's stack, declared in its
``preload_modules``, is imported once per run, not once per rank; spawning (the fallback) pays it per rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.targets.heavy_stack import LOG_ENV

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
CASES = """
[cases.w1]
contract = "usp.ulysses_parity"
world_size = 1

[cases.w2]
contract = "usp.ulysses_parity"
world_size = 2
"""


@pytest.mark.parametrize("method,imports", [("forkserver", 1), ("spawn", 3)])
def test_a_heavy_stack_is_imported_once_per_run_not_once_per_rank(tmp_path: Path, method: str, imports: int) -> None:
    (tmp_path / "cases.toml").write_text(CASES)
    log = tmp_path / "imports.log"
    env = {**os.environ, LOG_ENV: str(log), "PARITY_START_METHOD": method}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "check",
            "--cases",
            str(tmp_path),
            "--target",
            "tests.targets.heavy:factory",
        ],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out + err
    assert "2 passed" in out and "rank groups started in the background (W=1" in out
    pids = log.read_text().split()
    assert len(pids) == imports  # 3 ranks in all (W=1 and W=2): preloaded, only the server imported it
    assert str(proc.pid) not in pids  # the parent never needs the stack
