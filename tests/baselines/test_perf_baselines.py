"""Perf baselines in sglang's schema: load/validate/save, overlays, env tolerances, check rule."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from harness.baselines.perf import PerfBaselines, Tolerances, check_perf, tolerance_category
from harness.baselines.platforms import find_overlay, normalize_device_name
from harness.errors import ConfigError

# Shaped like sglang's perf_baselines.json, extra keys included (they must survive a round trip).
DOC = {
    "metadata": {"model": "Diffusion Server", "hardware": "CI H100 80GB", "last_updated": "2026-01-01"},
    "tolerances": {
        "long_term": {
            "e2e": 0.15,
            "denoise_stage": 0.1,
            "non_denoise_stage": 0.5,
            "denoise_step": 0.25,
            "denoise_agg": 0.15,
            "load_peak_vram": 0.01,
        },
        "pr_test": {
            "e2e": 0.25,
            "denoise_stage": 0.25,
            "non_denoise_stage": 0.8,
            "denoise_step": 0.3,
            "denoise_agg": 0.2,
            "load": 0.4,
        },
    },
    "improvement_reporting": {"threshold": 0.2},
    "sampling": {"step_fractions": [0.0, 0.5, 1.0]},
    "scenarios": {
        "flux_image_t2i": {
            "expected_load_ms": 29629.92,
            "stages_ms": {"TextEncodingStage": 20.0, "DenoisingStage": 6400.0, "DecodingStage": 10.0},
            "denoise_step_ms": {"0": 30.0, "1": 130.0, "2": 128.0},
            "expected_e2e_ms": 6700.0,
            "expected_avg_denoise_ms": 96.0,
            "expected_median_denoise_ms": 128.0,
            "_notes": "free text is kept",
            "estimated_full_test_time_s": 127.4,
            "load_peak_vram_mb": 1234.5,
            "runtime_peak_vram_mb": 2345.6,
        },
        "fast_hunyuan_video": {
            "stages_ms": {"DenoisingStage": 5898.72, "per_frame_generation": None},
            "denoise_step_ms": {"0": 286.89},
            "expected_e2e_ms": 11816.27,
            "expected_avg_denoise_ms": 286.89,
            "expected_median_denoise_ms": 286.89,
        },
        "action_http": {
            "stages_ms": {},
            "denoise_step_ms": {},
            "expected_e2e_ms": 21.37,
            "expected_avg_denoise_ms": 0.0,
            "expected_median_denoise_ms": 0.0,
        },
    },
}
PR = Tolerances(e2e=0.25, denoise_stage=0.25, non_denoise_stage=0.8, denoise_step=0.3, denoise_agg=0.2)


def _write(path: Path, doc: object) -> Path:
    path.write_text(json.dumps(doc, indent=4))
    return path


def test_load_round_trip_and_tolerances(tmp_path: Path) -> None:
    path = _write(tmp_path / "perf_baselines.json", DOC)
    pb = PerfBaselines.load(path)
    assert pb.to_json() == DOC
    assert pb.scenario_ids == ["flux_image_t2i", "fast_hunyuan_video", "action_http"]
    assert pb.tolerances("pr_test", env={}) == PR
    assert pb.tolerances("long_term", env={}).denoise_stage == 0.1
    assert pb.scenario("missing") is None
    out = tmp_path / "saved.json"
    pb.save(out)
    assert out.read_bytes() == path.read_bytes()


def test_env_overrides_tolerances(tmp_path: Path) -> None:
    pb = PerfBaselines.load(_write(tmp_path / "p.json", DOC))
    tol = pb.tolerances("pr_test", env={"PARITY_PERF_TOL_E2E": "0.5", "PARITY_PERF_TOL_DENOISE_STEP": "1"})
    assert (tol.e2e, tol.denoise_step, tol.denoise_agg) == (0.5, 1.0, 0.2)
    with pytest.raises(ConfigError, match="no tolerance profile 'nightly'"):
        pb.tolerances("nightly", env={})


@pytest.mark.parametrize("bad", ["abc", "-0.1", "nan", "inf"])
def test_a_bad_env_tolerance_is_refused_naming_its_variable(tmp_path: Path, bad: str) -> None:
    pb = PerfBaselines.load(_write(tmp_path / "p.json", DOC))
    with pytest.raises(ConfigError, match="PARITY_PERF_TOL_DENOISE_AGG"):
        pb.tolerances("pr_test", env={"PARITY_PERF_TOL_DENOISE_AGG": bad})


def test_overlay_replaces_scenarios_whole_and_merges_tolerances(tmp_path: Path) -> None:
    base = _write(tmp_path / "perf_baselines.json", DOC)
    platforms = tmp_path / "platforms"
    platforms.mkdir()
    overlay = _write(
        platforms / "mi300x.json",
        {
            "metadata": {"hardware": "MI300X"},
            "tolerances": {"pr_test": {"e2e": 0.5}},
            "scenarios": {"flux_image_t2i": {"expected_e2e_ms": 9000.0, "stages_ms": {"DenoisingStage": 8800.0}}},
        },
    )
    assert find_overlay(platforms, "AMD Instinct MI300X") == overlay
    pb = PerfBaselines.load(base, [overlay])
    flux = pb.scenario("flux_image_t2i")
    assert flux == {"expected_e2e_ms": 9000.0, "stages_ms": {"DenoisingStage": 8800.0}}  # no H100 leftovers
    assert pb.scenario("action_http") == DOC["scenarios"]["action_http"]
    tol = pb.tolerances("pr_test", env={})
    assert (tol.e2e, tol.denoise_stage) == (0.5, 0.25)
    assert pb.to_json()["metadata"] == {**DOC["metadata"], "hardware": "MI300X"}


def test_device_name_normalisation_picks_most_specific_overlay(tmp_path: Path) -> None:
    assert normalize_device_name("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert normalize_device_name("NVIDIA A100-SXM4-80GB") == "a100_sxm4_80gb"
    assert normalize_device_name("gfx942") == "gfx942"
    (tmp_path / "h100.json").write_text("{}")
    assert find_overlay(tmp_path, "NVIDIA H100 80GB HBM3") == tmp_path / "h100.json"
    (tmp_path / "h100_80gb.json").write_text("{}")
    assert find_overlay(tmp_path, "NVIDIA H100 80GB HBM3") == tmp_path / "h100_80gb.json"
    assert find_overlay(tmp_path, "NVIDIA H200") is None
    assert find_overlay(tmp_path, "NVIDIA") is None


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        (
            lambda d: d["scenarios"]["flux_image_t2i"].__setitem__("expected_e2e_ms", "fast"),
            "scenarios.flux_image_t2i.expected_e2e_ms",
        ),
        (
            lambda d: d["scenarios"]["flux_image_t2i"]["stages_ms"].__setitem__("DecodingStage", -1),
            "scenarios.flux_image_t2i.stages_ms.DecodingStage",
        ),
        (
            lambda d: d["scenarios"]["flux_image_t2i"]["denoise_step_ms"].__setitem__("first", 1.0),
            "scenarios.flux_image_t2i.denoise_step_ms",
        ),
        (lambda d: d["scenarios"]["flux_image_t2i"].pop("expected_e2e_ms"), "scenarios.flux_image_t2i"),
        (lambda d: d["tolerances"]["pr_test"].__setitem__("e2e", None), "tolerances.pr_test.e2e"),
        (lambda d: d["metadata"].__setitem__("hardware", 100), "metadata.hardware"),
        (lambda d: d.__setitem__("scenarios", [1]), "scenarios"),
    ],
)
def test_invalid_documents_name_file_and_key(tmp_path: Path, mutate, key: str) -> None:
    doc = copy.deepcopy(DOC)
    mutate(doc)
    path = _write(tmp_path / "bad.json", doc)
    with pytest.raises(ConfigError) as info:
        PerfBaselines.load(path)
    assert (info.value.path, info.value.key) == (str(path), key)


def test_missing_tolerance_is_named(tmp_path: Path) -> None:
    doc = copy.deepcopy(DOC)
    del doc["tolerances"]["pr_test"]["denoise_agg"]
    with pytest.raises(ConfigError, match="tolerances.pr_test.denoise_agg"):
        PerfBaselines.load(_write(tmp_path / "p.json", doc)).tolerances("pr_test", env={})


def test_tolerance_categories() -> None:
    assert tolerance_category("expected_e2e_ms") == "e2e"
    assert tolerance_category("stages_ms.DenoisingStage") == "denoise_stage"
    assert tolerance_category("stages_ms.Ideogram4DenoisingStage") == "denoise_stage"
    assert tolerance_category("stages_ms.TextEncodingStage") == "non_denoise_stage"
    assert tolerance_category("denoise_step_ms.7") == "denoise_step"
    assert tolerance_category("expected_median_denoise_ms") == "denoise_agg"


def _by_metric(checks):
    return {c.metric: c for c in checks}


def test_check_perf_rule_per_family() -> None:
    expected = DOC["scenarios"]["flux_image_t2i"]
    measured = {
        "expected_e2e_ms": 6700.0 * 1.25,  # exactly at the e2e limit: passes
        "stages_ms": {"TextEncodingStage": 36.0, "DenoisingStage": 8000.1, "DecodingStage": 10.0, "NewStage": 5.0},
        "denoise_step_ms": {"0": 39.0, "1": 169.1},  # step 2 missing
        "expected_avg_denoise_ms": 115.2,
        "expected_median_denoise_ms": 153.7,
    }
    checks = _by_metric(check_perf(expected, measured, PR))
    assert checks["expected_e2e_ms"].passed and checks["expected_e2e_ms"].limit == pytest.approx(8375.0)
    assert checks["stages_ms.TextEncodingStage"].passed  # 36 <= 20 * 1.8
    assert checks["stages_ms.TextEncodingStage"].tol == 0.8
    assert not checks["stages_ms.DenoisingStage"].passed  # 8000.1 > 6400 * 1.25
    assert checks["stages_ms.DenoisingStage"].tol == 0.25
    assert checks["denoise_step_ms.0"].passed  # 39 <= 30 * 1.3
    assert not checks["denoise_step_ms.1"].passed  # 169.1 > 130 * 1.3
    missing = checks["denoise_step_ms.2"]
    assert missing.actual is None and not missing.passed  # a vanished step is not a pass
    # exactly at the limit passes although 96 * 1.2 == 115.19999999999999 in floating point
    assert checks["expected_avg_denoise_ms"].passed and checks["expected_avg_denoise_ms"].tol == 0.2
    assert not checks["expected_median_denoise_ms"].passed  # 153.7 > 128 * 1.2
    assert "stages_ms.NewStage" not in checks  # no baseline: not checked


def test_check_perf_skips_untracked_aggregates_and_abs_floor() -> None:
    expected = DOC["scenarios"]["action_http"]
    checks = _by_metric(check_perf(expected, {"expected_e2e_ms": 27.0, "expected_avg_denoise_ms": 3.0}, PR))
    assert list(checks) == ["expected_e2e_ms"]  # 0.0 avg/median without steps = not measured by sglang
    assert not checks["expected_e2e_ms"].passed  # 27 > 21.37 * 1.25
    padded = check_perf(expected, {"expected_e2e_ms": 40.0}, dataclasses.replace(PR, abs_floor_ms=20.0))
    assert padded[0].passed and padded[0].limit == pytest.approx(41.37)


def test_sglangs_per_frame_time_is_kept_but_not_gated_as_a_stage() -> None:
    """sglang writes ``per_frame_generation`` (null when it had no frame rate) among a video's stages and checks it
    as a frame rate; a measurement of parity's has no such stage, and must not fail for lacking it."""
    expected = DOC["scenarios"]["fast_hunyuan_video"]
    measured = {
        "expected_e2e_ms": 11000.0,
        "stages_ms": {"DenoisingStage": 5800.0},
        "denoise_step_ms": {"0": 280.0},
        "expected_avg_denoise_ms": 280.0,
        "expected_median_denoise_ms": 280.0,
    }
    checks = _by_metric(check_perf(expected, measured, PR))
    assert "stages_ms.per_frame_generation" not in checks
    assert all(c.passed for c in checks.values()) and len(checks) == 5


@pytest.mark.parametrize(
    ("mutate", "key", "hint"),
    [
        (
            lambda d: d["scenarios"]["flux_image_t2i"].__setitem__("expected_e2e_mss", 1.0),
            "scenarios.flux_image_t2i.expected_e2e_mss",
            "did you mean 'expected_e2e_ms'",
        ),
        (
            lambda d: d["tolerances"]["pr_test"].__setitem__("denoise_stepp", 0.1),
            "tolerances.pr_test.denoise_stepp",
            "did you mean 'denoise_step'",
        ),
        (
            lambda d: d["tolerances"].__setitem__("pr_tset", {"e2e": 0.1}),
            "tolerances.pr_tset",
            "did you mean 'pr_test'",
        ),
        (lambda d: d.__setitem__("scenario", {}), "scenario", "did you mean 'scenarios'"),
        (
            lambda d: d["scenarios"]["flux_image_t2i"]["stages_ms"].__setitem__("per_frame_generation", "40"),
            "scenarios.flux_image_t2i.stages_ms.per_frame_generation",
            "expected a number",
        ),
    ],
    ids=["scenario_key", "tolerance_key", "profile", "top_key", "per_frame_a_string"],
)
def test_a_misspelt_key_is_refused_naming_file_key_and_the_nearest_key(
    tmp_path: Path, mutate, key: str, hint: str
) -> None:
    """Each of these was ignored: the scenario gated without its e2e bound, the profile at its file's values."""
    doc = copy.deepcopy(DOC)
    mutate(doc)
    path = _write(tmp_path / "perf_baselines.json", doc)
    with pytest.raises(ConfigError, match=hint) as info:
        PerfBaselines.load(path)
    assert (info.value.path, info.value.key) == (str(path), key)
