"""Acceptance (issue 24): parity as another project's CI uses it, from a wheel built in this run.

The wheel is built from this checkout and installed (not editable) into a fresh venv whose only
link to the outer one is a ``.pth`` line naming its site-packages, for torch and the other
dependencies (the outer venv's ``.pth`` files, its editable finder among them, are not run that
way, so ``harness`` comes from the wheel alone). A project made by ``parity init`` outside the
checkout then gates a ``command`` pipeline and a ``module:factory`` attention target of its own,
blesses from the gate's hint run verbatim, gates, recalibrates and compares; the installed
package tree and parity's own baselines are byte for byte what they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from harness.paths import default_baselines_dir

CHECKOUT = Path(__file__).resolve().parents[2]
GENERATOR = CHECKOUT / "tests" / "targets" / "fake_generator.py"
IMAGE_CASES = """\
[defaults]
unmeasured = { clip = "no CLIP model configured" }
prompt = "a lighthouse at dusk"
seed = 3
height = 24
width = 32

[cases.gen_2ranks]
world_size = 2
"""
TARGET = """\
from harness.targets.reference.attention import factory as reference


def factory():
    \"\"\"This project's attention target (here parity's reference under another name).\"\"\"
    return reference()
"""

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # CI runs every marker


def _tree_digest(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` except bytecode (which Python may cache at will)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def _install_from_a_wheel(root: Path) -> Path:
    """A fresh venv with parity installed from a wheel built now (from a copy of the tree: setuptools' build/
    and egg-info stay out of the checkout); the venv."""
    source = root / "source"
    shutil.copytree(
        CHECKOUT,
        source,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            ".hypothesis",
            "parity-report",
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(root / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (root / "dist").glob("parity-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "outer_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
    )
    return root / "venv"


def _parity(venv: Path, cwd: Path, *words: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PARITY_HOME", "PYTHONPATH", "VIRTUAL_ENV")}
    env["COLUMNS"] = "400"  # one hint per line
    return subprocess.run(
        [str(venv / "bin" / "parity"), *words], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_wheel_gates_its_defaults_and_a_project_outside_the_checkout(tmp_path: Path) -> None:
    """One test, so the wheel is built once (by one xdist worker) and every step is timed."""
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(step: str) -> None:
        nonlocal clock
        timings[step], clock = time.perf_counter() - clock, time.perf_counter()

    venv = _install_from_a_wheel(tmp_path)
    lap("build + install")
    site = Path(
        subprocess.check_output(
            [str(venv / "bin" / "python"), "-c", "import harness; print(harness.__file__)"], cwd=tmp_path, text=True
        ).strip()
    ).parent.parent
    assert site.is_relative_to(venv) and (site / "parity" / "_data" / "cases" / "contracts").is_dir()
    package = {name: _tree_digest(site / name) for name in ("harness", "reference_impl", "parity")}
    own = _tree_digest(default_baselines_dir())

    bare = tmp_path / "no-project"
    bare.mkdir()
    doctor = _parity(venv, bare, "doctor", "--json", "-")
    assert doctor.returncode == 0, doctor.stderr
    found = json.loads(doctor.stdout)
    assert found["project"] is None and Path(found["paths"]["baselines"]) == site / "parity" / "_data" / "baselines"
    defaults = _parity(venv, bare, "gate")  # the embedded cases and baselines, no PARITY_HOME
    assert defaults.returncode == 0, defaults.stdout + defaults.stderr
    lap("doctor + gate on the embedded defaults")
    refused = _parity(venv, bare, "bless", "zimage_t2i_1rank")  # never into the installed package
    assert refused.returncode == 2 and "parity init" in refused.stderr and "PARITY_HOME" in refused.stderr
    assert "--baselines" not in refused.stderr

    project = tmp_path / "myproject"

    made = _parity(venv, tmp_path, "init", str(project))
    assert made.returncode == 0, made.stderr
    assert f"cd {project}" in made.stdout and "parity bless --all" in made.stdout
    shutil.copy(GENERATOR, project / "gen.py")
    (project / "mytarget.py").write_text(TARGET)
    (project / "parity" / "cases" / "images" / "example.toml").write_text(IMAGE_CASES)
    with (project / "parity.toml").open("a") as fh:
        fh.write('target = "mytarget:factory"\n')
    python = shlex.quote(str(venv / "bin" / "python"))
    template = (
        f"{python} gen.py --prompt {{prompt}} --seed {{seed}} --height {{height}} --width {{width}} --out {{out_dir}}"
    )
    pipeline = [
        "--pipeline-target",
        "command",
        "--pipeline-target-arg",
        f"template={template}",
    ]  # not in the project file

    first = _parity(venv, project, "gate", "--report", "r1", *pipeline)
    assert first.returncode == 1, first.stdout + first.stderr
    records = {
        r["case_id"]: r
        for r in json.loads((project / "r1" / "results.json").read_text())["stages"]["images"]["records"]
    }
    hint = records["gen_2ranks"]["next_step"]
    assert records["gen_2ranks"]["reason"] == f"no reference yet: run `{hint}`" and f"    -> {hint}" in first.stdout
    contracts = json.loads((project / "r1" / "results.json").read_text())
    assert contracts["target"] == "mytarget:factory" and contracts["project"] == str(project / "parity.toml")
    assert {r["status"] for r in contracts["stages"]["contracts"]["records"]} == {"passed"}

    words = shlex.split(hint)
    assert words[:3] == ["parity", "bless", "gen_2ranks"] and "--pipeline-target" in words
    blessed = _parity(venv, project, *words[1:])  # the hint, verbatim
    assert blessed.returncode == 0, blessed.stdout + blessed.stderr
    assert (project / "parity" / "baselines" / "images" / "gen_2ranks.png").is_file()

    again = _parity(venv, project, "gate", "--report", "r2", *pipeline)
    assert again.returncode == 0, again.stdout + again.stderr
    recalibrated = _parity(venv, project, "recalibrate", "thresholds", "--results", "r2/results.json", "--write")
    assert recalibrated.returncode == 0, recalibrated.stdout + recalibrated.stderr
    thresholds = project / "parity" / "baselines" / "consistency_threshold.json"
    assert f"thresholds -> {thresholds}" in recalibrated.stdout and "│ gen_2ranks │ ssim" in recalibrated.stdout
    assert (
        f"{thresholds}: unchanged, not rewritten" in recalibrated.stdout
    )  # the defaults are the policy's caps already
    compared = _parity(venv, project, "compare", "r1/results.json", "r2/results.json")
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert "images/gen_2ranks: failed -> passed" in compared.stdout
    lap("project: init, gate, bless from the hint, gate, recalibrate, compare")
    print("; ".join(f"{step} {seconds:.1f} s" for step, seconds in timings.items()))

    assert {name: _tree_digest(site / name) for name in package} == package
    assert _tree_digest(default_baselines_dir()) == own
