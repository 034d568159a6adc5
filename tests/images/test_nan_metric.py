"""A metric that comes out NaN fails its case with the reason and leaves a results file that reads back."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import harness.gate.images as image_stage
from harness.baselines.thresholds import ThresholdSet
from harness.cases.image import ImageCase
from harness.errors import ConfigError
from harness.paths import default_baselines_dir
from harness.results import FAILED, StageResult, image_entry, load_results, results_document, write_results


def test_a_nan_metric_fails_the_case_and_the_results_file_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = image_stage.measure

    def clip_gives_nan(*args: object) -> dict[str, float | None]:
        return {**real(*args), "clip": math.nan}  # as a CLIP model whose embedding has zero norm would

    monkeypatch.setattr(image_stage, "measure", clip_gives_nan)
    image = np.zeros((16, 16, 3), np.uint8)
    case = ImageCase("c", "image", 1, 1, 1, {"prompt": "x"}, source="test")
    bounds = ThresholdSet.load(default_baselines_dir() / "consistency_threshold.json").for_case(case.id, "image")
    result = image_stage.judge_case(case, image, image.copy(), bounds, None, None)
    assert result.status == FAILED and "clip is NaN" in (result.reason or "")
    assert result.figures["clip"] is None and result.figures["skipped_metrics"] == {"clip": "came out NaN"}
    assert image_entry(result)["metrics"]["psnr"] == "inf"
    path = tmp_path / "results.json"
    stage = StageResult("images", [result], 0.1, top_level={"cases": {"c": image_entry(result)}})
    doc = results_document("gate", {"device": "cpu"}, {"images": stage}, 0.1)
    write_results(path, doc)
    assert load_results(path)["cases"]["c"]["metrics"]["clip"] is None


@pytest.mark.parametrize("where", ["top_level", "image_entry"])
def test_a_misspelt_key_in_a_results_file_is_refused_naming_it(where: str, tmp_path: Path) -> None:
    """Recalibration reads these files back: a key parity never writes is a hand edit, not a figure to ignore."""
    entry = {"kind": "image", "passed": True, "metrics": {"clip": None, "ssim": 1.0, "psnr": "inf"}}
    doc = {"command": "gate", "stages": {}, "cases": {"c": entry}}
    if where == "top_level":
        doc["platfrom"] = "cpu_x86_64"
    else:
        entry["treshold_source"] = {}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as info:
        load_results(path)
    key = "platfrom" if where == "top_level" else "cases.c.treshold_source"
    assert str(path) in str(info.value) and f"key '{key}'" in str(info.value) and "did you mean" in str(info.value)
