"""The pytest plugin from a user's suite (a real ``pytest`` in a project folder of its own): a planted bug is red
whichever way the target is given (flags, parity.toml, the test's own ``target=`` with flag arguments), a
conflict fails instead of dropping one side, ``image_regression`` blesses, passes and fails like
pytest-regressions' fixture, and ``--parity-cases`` makes every case of the project's files a test
(issue 39: ``--parity-target-arg`` was dropped when a test passed ``target=``, a false green)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
JITTERY = "tests.targets.jittery:factory"
PLANT = "defect=wrong_few_heads"  # a Ulysses rank's layer of fewer heads computes 1.5x the attention
CASE = 'assert_contract("usp.ulysses_parity", world_size=2, dtype="fp32"{target})'
TESTS = f"""
def test_default(assert_contract):
    {CASE.format(target="")}


def test_own_target(assert_contract):
    {CASE.format(target=f", target={JITTERY!r}")}
"""


def _pytest(root: Path, *argv: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *argv],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    return done.returncode, done.stdout + done.stderr


def _outcomes(out: str) -> dict[str, str]:
    """``{test name: PASSED/FAILED/...}`` from ``-rA``'s short summary."""
    return {m[1]: m[0] for m in re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR) \S+::(\w+)", out, re.M)}


def _project(root: Path, toml: str = "", tests: str = TESTS) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "parity.toml").write_text(toml)
    (root / "test_user.py").write_text(tests)
    return root


@pytest.mark.parametrize(
    ("toml", "argv", "expected"),
    [
        ("", ["--parity-target", JITTERY, "--parity-target-arg", PLANT], {"test_default": "FAILED"}),
        (f'target = "{JITTERY}"\ntarget_args = {{ defect = "wrong_few_heads" }}\n', [], {"test_default": "FAILED"}),
        ("", ["--parity-target-arg", PLANT], {"test_default": "FAILED", "test_own_target": "FAILED"}),
        ("", [], {"test_default": "PASSED", "test_own_target": "PASSED"}),
    ],
    ids=["flags", "parity-toml", "test-target-with-flag-args", "no-plant"],
)
def test_a_planted_bug_is_red_however_the_target_is_given(
    tmp_path: Path, toml: str, argv: list[str], expected: dict[str, str]
) -> None:
    code, out = _pytest(_project(tmp_path / "user", toml), "-rA", *argv)
    outcomes = _outcomes(out)
    assert {k: outcomes.get(k) for k in expected} == expected, out
    assert code == (1 if "FAILED" in outcomes.values() else 0), out


def test_a_tests_target_against_another_given_above_it_fails_naming_both(tmp_path: Path) -> None:
    code, out = _pytest(_project(tmp_path / "user"), "-rA", "--parity-target", "reference", "-k", "own_target")
    assert code == 1 and _outcomes(out) == {"test_own_target": "FAILED"}, out
    assert f"the test asks for target {JITTERY!r}, --parity-target names 'reference': remove one" in out


IMAGE_TEST = """
import numpy as np


def test_picture(image_regression):
    image = np.full((16, 16, 3), 100, np.uint8)
    image[4:8, 4:8] = {value}
    image_regression.check(image)
"""


def test_image_regression_blesses_then_passes_then_fails_a_changed_image(tmp_path: Path) -> None:
    root = _project(tmp_path / "user", tests=IMAGE_TEST.format(value=200))
    code, out = _pytest(root)
    assert code == 1 and "no reference yet: blessed it in" in out, out
    assert (root / "test_user" / "test_picture.png").is_file()
    code, out = _pytest(root)
    assert code == 0, out
    (root / "test_user.py").write_text(IMAGE_TEST.format(value=0))
    code, out = _pytest(root)
    assert code == 1 and "test_picture differs from its reference" in out and "psnr" in out, out


CASES = """
[defaults]
world_size = 2
dtype = "fp32"

[cases.mine_ulysses]
contract = "usp.ulysses_parity"

[cases.mine_ring]
contract = "usp.ring_parity"
"""


@pytest.mark.slow
def test_parity_cases_collects_one_item_per_case_and_k_selects(tmp_path: Path) -> None:
    root = _project(tmp_path / "user", 'cases = "cases"\n', tests="")
    (root / "cases" / "contracts").mkdir(parents=True)
    (root / "cases" / "contracts" / "mine.toml").write_text(CASES)
    code, out = _pytest(root, "--parity-cases", "-rA", "cases/contracts")
    assert code == 0, out
    assert (
        "PASSED cases/contracts/mine.toml::mine_ulysses" in out and "PASSED cases/contracts/mine.toml::mine_ring" in out
    )
    code, out = _pytest(root, "--parity-cases", "-rA", "cases/contracts", "-k", "ring")
    assert code == 0 and "mine_ring" in out and "mine_ulysses" not in out and "1 deselected" in out, out
    code, out = _pytest(
        root, "--parity-cases", "-rA", "cases/contracts", "--parity-target", JITTERY, "--parity-target-arg", PLANT
    )
    assert code == 1 and "FAILED cases/contracts/mine.toml::mine_ulysses" in out, out
