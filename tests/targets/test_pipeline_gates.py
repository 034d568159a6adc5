"""Acceptance (issue 18): ``parity bless`` then ``parity gate`` with the ``command`` and ``diffusers`` pipeline targets.

Each test builds a project in a temp dir (one cheap contract case, image cases, the project's own
thresholds), blesses the references from the target, gates against them (exit 0), then gates a
perturbed pipeline (exit 1, with a triptych PNG in the report).
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest

from harness.baselines.images import load_reference
from harness.cli import main
from harness.report.triptych import triptych
from harness.results import load_results
from harness.targets.diffusers_pipeline import CPU_REASON
from tests.gate_project import gate_project
from tests.targets.tiny_flux import FLUX_CASES, save_tiny_flux

pytestmark = pytest.mark.timeout(600)

GENERATOR = Path(__file__).with_name("fake_generator.py")
COMMAND_CASES = """\
[defaults]
prompt = "a lighthouse at dusk"
seed = 3
height = 24
width = 32

[cases.cmd_1rank]

[cases.cmd_2ranks]
world_size = 2
"""
REFERENCE_CASES = """\
[defaults]
target = "reference"
prompt = "a lighthouse at dusk"
height = 16
width = 16
steps = 2

[cases.ref_1rank]
"""


@pytest.fixture(autouse=True)
def _kept_outputs_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed command's output directory is kept for a human to read: in tests, inside tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _records(doc: dict, stage: str = "images") -> dict[str, dict]:
    return {r["case_id"]: r for r in doc["stages"][stage]["records"]}


def _assert_triptych(report: Path, record: dict, baselines: Path) -> None:
    """The report's triptych is reference | candidate | diff of the blessed reference and the output the run saved."""
    reference = load_reference(baselines / "images", record["case_id"])
    candidate = load_reference(report / "candidates", record["case_id"])  # the failing run's output, kept by the gate
    assert candidate.shape == reference.shape and not np.array_equal(candidate, reference)
    drawn = triptych(reference, candidate)
    assert np.array_equal(iio.imread(report / record["artifacts"]["triptych"]), drawn.picture)
    (y, x, h, w), _, _ = drawn.panels[0]
    assert np.array_equal(drawn.picture[y : y + h : drawn.scale, x : x + w : drawn.scale], reference)


def test_command_target_gate_passes_then_fails_a_planted_multi_rank_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases, baselines = gate_project(tmp_path, command=COMMAND_CASES)
    log = tmp_path / "calls.jsonl"
    template = (
        f"{shlex.quote(sys.executable)} {shlex.quote(str(GENERATOR))} --prompt {{prompt}} --seed {{seed}} --height {{height}} "
        f"--width {{width}} --out {{out_dir}} --world-size {{world_size}} --timings {{timings}} --log {shlex.quote(str(log))}"
    )

    def run(verb: str, template: str, *extra: str) -> int:
        return main(
            [
                verb,
                "--cases",
                str(cases),
                "--baselines",
                str(baselines),
                "--pipeline-target",
                "command",
                "--pipeline-target-arg",
                f"template={template}",
                *extra,
            ]
        )

    assert run("bless", template + " --fail", "--all") == 1  # a failing command: its stderr shown, nothing written
    assert "CUDA out of memory (planted)" in capsys.readouterr().err and not (baselines / "images").exists()
    log.unlink()
    assert run("bless", template, "--all") == 0
    assert [json.loads(line)["world_size"] for line in log.read_text().splitlines()] == [
        1
    ]  # both cases: one 1-rank run

    report = tmp_path / "healthy"
    assert run("gate", template, "--report", str(report), "--perf", "--perf-runs", "1", "--perf-warmup", "0") == 0
    doc = load_results(report / "results.json")
    images, perf = _records(doc), _records(doc, "perf")
    both = ("cmd_1rank", "cmd_2ranks")
    got = {
        c: (
            images[c]["status"],
            doc["cases"][c]["metrics"]["psnr"],
            images[c]["target"],
            images[c]["params"]["target_args"],
            "timings: timings.json" in images[c]["kernel"],
            perf[c]["target"],
            perf[c]["figures"]["clock"],
        )
        for c in both
    }
    assert got == dict.fromkeys(
        both, ("passed", float("inf"), "command", {"template": template}, True, "command", "command timings.json")
    )
    measured = doc["perf"]["cmd_2ranks"]  # the command's own timings.json, raw
    assert measured["stages_ms"]["DenoisingStage"] == 1.5
    assert "2" not in doc["stages"]["images"]["pool_startup_s"]  # W=2 asked of the command, no 2-rank group
    assert 2 in [json.loads(line)["world_size"] for line in log.read_text().splitlines()]

    report = tmp_path / "perturbed"
    assert run("gate", template + " --sp-bug", "--report", str(report)) == 1
    doc = load_results(report / "results.json")
    images = _records(doc)
    assert images["cmd_1rank"]["status"] == "passed"  # the planted error needs more than one rank
    failed = images["cmd_2ranks"]
    assert (
        failed["status"] == "failed"
        and "psnr" in failed["reason"]
        and doc["cases"]["cmd_2ranks"]["metrics"]["psnr"] < 30
    )
    print(
        f"FIGURE command perturbed cmd_2ranks {doc['cases']['cmd_2ranks']['metrics']} in {failed['duration_s']:.2f} s"
    )
    _assert_triptych(report, failed, baselines)
    assert 'name="cmd_2ranks"' in (report / "junit.xml").read_text()


def test_diffusers_target_gate_passes_then_fails_a_planted_attention_error(tmp_path: Path) -> None:
    flux = save_tiny_flux(tmp_path / "flux")
    cases, baselines = gate_project(tmp_path, flux=FLUX_CASES, reference=REFERENCE_CASES)

    def run(verb: str, target: str, *extra: str) -> int:
        return main(
            [
                verb,
                "--cases",
                str(cases),
                "--baselines",
                str(baselines),
                "--pipeline-target",
                target,
                "--pipeline-target-arg",
                f"path={flux}",
                *extra,
            ]
        )

    assert (
        run("bless", "diffusers", "--all") == 0
    )  # flux cases from diffusers, ref_1rank from its own target, the reference
    report = tmp_path / "healthy"
    assert run("gate", "diffusers", "--report", str(report)) == 0
    doc = load_results(report / "results.json")
    images = _records(doc)
    assert images["flux_1rank"]["status"] == "passed" and doc["cases"]["flux_1rank"]["metrics"]["psnr"] == float("inf")
    assert (
        images["flux_1rank"]["target"] == "diffusers"
        and images["flux_1rank"]["figures"]["backends"]["pipeline"] == "FluxPipeline"
    )
    assert images["ref_1rank"]["status"] == "passed" and images["ref_1rank"]["target"] == "reference"
    assert (
        "target_args" not in images["ref_1rank"]["params"]
    )  # another target than --pipeline-target: built without them
    assert images["flux_2ranks"]["status"] == "skipped" and images["flux_2ranks"]["reason"] == CPU_REASON
    print(
        f"FIGURE diffusers healthy flux_1rank {images['flux_1rank']['duration_s']:.2f} s, e2e "
        f"{images['flux_1rank']['figures']['e2e_ms']:.1f} ms, gate wall {doc['wall_s']:.1f} s"
    )

    report = tmp_path / "perturbed"
    assert run("gate", "tests.targets.planted_attention:factory", "--report", str(report)) == 1
    doc = load_results(report / "results.json")
    images = _records(doc)
    failed = images["flux_1rank"]
    assert failed["status"] == "failed" and failed["target"] == "tests.targets.planted_attention:factory"
    assert doc["cases"]["flux_1rank"]["metrics"]["psnr"] < 30 and "psnr" in failed["reason"]
    assert (
        "[reference blessed from pipeline target 'diffusers', this run: 'tests.targets.planted_attention:factory']"
        in failed["reason"]
    )
    print(
        f"FIGURE diffusers perturbed flux_1rank {doc['cases']['flux_1rank']['metrics']} in {failed['duration_s']:.2f} s"
    )
    assert images["ref_1rank"]["status"] == "passed"  # its own target: untouched by --pipeline-target
    _assert_triptych(report, failed, baselines)
