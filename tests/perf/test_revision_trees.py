"""The tree a ``rev:`` side exports is removed at the run's end; one a SIGKILLed run left (no exit hook runs) is
removed when the next run starts, found by the owner's pid in its name (issue 39, leftover 7: 5 of 5 kills
left a 4.4 MB ``parity-rev-*`` tree)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.perf.sides import TREE_PREFIX, Revisions, remove_orphaned_trees

REPO = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid  # reaped: no process has it (until the kernel reuses it)


def test_only_trees_of_gone_owners_are_removed(tmp_path: Path) -> None:
    orphan = tmp_path / f"{TREE_PREFIX}0123456789ab-p{_dead_pid()}-x1"
    mine = tmp_path / f"{TREE_PREFIX}0123456789ab-p{os.getpid()}-x2"
    foreign = tmp_path / f"{TREE_PREFIX}notours"
    for tree in (orphan, mine, foreign):
        (tree / "reference_impl").mkdir(parents=True)
    assert remove_orphaned_trees(tmp_path) == [orphan]
    assert not orphan.exists() and mine.is_dir() and foreign.is_dir()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGKILL")
def test_a_sigkilled_runs_tree_is_gone_once_the_next_run_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real export by a process then SIGKILLed while holding it (as `parity perf rev:...` is), then a new run."""
    script = (
        "import sys, time\nfrom harness.perf.sides import Revisions\nfrom harness.targets.spec import TargetSpec\n"
        "Revisions().resolve(TargetSpec('rev:HEAD'))\nprint('exported', flush=True)\ntime.sleep(600)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "exported"
    (tree,) = tmp_path.glob(f"{TREE_PREFIX}*-p{proc.pid}-*")
    assert (tree / "reference_impl").is_dir()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert tree.is_dir()  # SIGKILL: nothing ran on the way out
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    with Revisions():
        pass
    assert not tree.exists()  # the next run's start removed it
