"""NaN/Inf in a pipeline's output fails the image case and cannot be blessed, whatever its uint8 pixels say.

Measured before: ``flow_shift = nan`` blessed an all-black reference and the gate then PASSED,
because the uint8 conversion turns NaN into 0 and the candidate was equally black.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from harness.cli import main
from harness.results import load_results
from tests.gate_project import gate_project

pytestmark = pytest.mark.timeout(300)

CLEAN, NAN = "tests.images.nan_pipeline:clean", "tests.images.nan_pipeline:nan"


def test_the_reference_pipeline_counts_nan_that_its_uint8_output_hides(monkeypatch: pytest.MonkeyPatch) -> None:
    import reference_impl.pipeline as pipeline

    config = pipeline.PipelineConfig(height=16, width=16, steps=1)
    assert pipeline.run_pipeline(config).nonfinite == 0
    monkeypatch.setattr(pipeline, "flow_sigmas", lambda steps, shift: [math.nan] * (steps + 1))
    result = pipeline.run_pipeline(config)
    assert not result.output.any()  # a black image: indistinguishable from a legitimate one by its pixels
    assert result.nonfinite == result.latents.size + 16 * 16 * 3  # every latent and every decoded value


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nan_in_a_case_float_is_refused_before_any_run(value: float) -> None:
    from reference_impl.models.layers import ModelConfigError
    from reference_impl.pipeline import PipelineConfig

    with pytest.raises(ModelConfigError, match="flow_shift.*finite"):
        PipelineConfig(flow_shift=value)


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, Path]:
    return gate_project(tmp_path, tiny="[cases.black]\nworld_size = 1\n")


def test_bless_refuses_a_nan_run_and_writes_nothing(
    project: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cases, baselines = project
    assert main(["bless", "--cases", str(cases), "--baselines", str(baselines), "--pipeline-target", NAN, "--all"]) == 2
    err = capsys.readouterr().err
    assert str(cases / "images" / "tiny.toml") in err and "key 'cases.black'" in err
    assert "refusing to bless: the pipeline produced 768 NaN/Inf values" in err
    assert not (baselines / "images").exists()


def test_gate_fails_a_nan_run_that_matches_its_black_reference(project: tuple[Path, Path], tmp_path: Path) -> None:
    cases, baselines = project
    assert (
        main(["bless", "--cases", str(cases), "--baselines", str(baselines), "--pipeline-target", CLEAN, "--all"]) == 0
    )
    gate = ["gate", "--cases", str(cases), "--baselines", str(baselines), "--no-perf"]
    assert main([*gate, "--pipeline-target", CLEAN]) == 0  # the control: black matches black
    out = tmp_path / "results.json"
    assert main([*gate, "--pipeline-target", NAN, "--json", str(out)]) == 1
    doc = load_results(out)
    record = doc["stages"]["images"]["records"][0]
    assert record["status"] == "failed" and "768 NaN/Inf values" in record["reason"]
    assert (
        record["figures"]["psnr"] == "inf" and record["figures"]["nonfinite"] == 768
    )  # identical pixels, still failed
    assert doc["cases"]["black"]["passed"] is False and doc["passed"] is False
