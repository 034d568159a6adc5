"""A green means verified: a run that checked nothing, or a target that cannot load, never exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_a_check_in_which_every_case_skipped_says_nothing_ran_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "ring_admission"]) == 2  # no backend without the LSE on the CPU: pinned, so a skip
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "check: NOTHING RAN (1 case, every one skipped: nothing was checked; exit 2)"


def test_gate_on_a_stack_that_cannot_be_imported_exits_2_with_the_install_hint(tmp_path: Path) -> None:
    """As on a CI machine whose install of sglang broke: its import fails; the gate must not go green."""
    shadow = tmp_path / "shadow" / "sglang"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('a broken install (planted)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), str(REPO)])}
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", "gate", "--target", "sglang", "--no-perf"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "key '--target': target 'sglang' cannot run on cpu: sglang" in proc.stderr
    assert "install-sglang-cpu.sh" in proc.stderr and "gate: PASSED" not in proc.stdout


@pytest.mark.parametrize("verb", ["check", "gate", "sweep"])
def test_a_target_that_does_not_load_is_the_target_options_error(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([verb, "--target", "no_such_module_xyz:factory"]) == 2
    assert "error: key '--target': target 'no_such_module_xyz:factory': cannot import module" in capsys.readouterr().err
