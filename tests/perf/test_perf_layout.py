"""Where a machine's perf baseline comes from: base tolerances, base scenarios only on the
machine the base names, the most specific overlay under platforms/perf/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.baselines.perf import PerfBaselines, perf_overlay_path
from harness.baselines.platforms import platform_name
from harness.errors import ConfigError

TOL = {"e2e": 0.25, "denoise_stage": 0.25, "non_denoise_stage": 0.8, "denoise_step": 0.3, "denoise_agg": 0.2}


def _write(path: Path, doc: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def test_base_scenarios_apply_only_on_the_named_platform(tmp_path: Path) -> None:
    _write(
        tmp_path / "perf_baselines.json",
        {
            "metadata": {"hardware": "NVIDIA H200", "platform": "h200"},
            "tolerances": {"pr_test": {**TOL, "abs_floor_ms": 1.5}},
            "scenarios": {"a": {"expected_e2e_ms": 10.0}},
        },
    )
    assert PerfBaselines.for_platform(tmp_path, "h200").scenario_ids == ["a"]
    assert PerfBaselines.for_platform(tmp_path, "h200_nvl").scenario_ids == ["a"]  # token prefix
    other = PerfBaselines.for_platform(tmp_path, "h20")
    assert other.scenario_ids == []  # another machine has no baseline, not the H200's
    assert other.tolerances("pr_test", env={}).abs_floor_ms == 1.5
    assert other.tolerances("pr_test", env={"PARITY_PERF_TOL_ABS_FLOOR_MS": "3"}).abs_floor_ms == 3.0
    assert other.paths == [str(tmp_path / "perf_baselines.json")]


def test_overlay_under_platforms_perf_beside_threshold_overlays(tmp_path: Path) -> None:
    _write(tmp_path / "perf_baselines.json", {"tolerances": {"pr_test": TOL}})
    _write(tmp_path / "platforms" / "mi300x.json", {"cases": {}})  # a threshold overlay: not perf
    overlay = _write(
        perf_overlay_path(tmp_path, "mi300x"),
        {
            "tolerances": {"pr_test": {"e2e": 0.5}},
            "scenarios": {"a": {"expected_e2e_ms": 7.0}},
        },
    )
    assert overlay == tmp_path / "platforms" / "perf" / "mi300x.json"
    pb = PerfBaselines.for_platform(tmp_path, "mi300x")
    assert pb.scenario("a") == {"expected_e2e_ms": 7.0}
    assert pb.tolerances("pr_test", env={}).e2e == 0.5
    assert pb.paths[-1] == str(overlay)
    assert PerfBaselines.for_platform(tmp_path, "cpu_x86_64").scenario_ids == []


def test_missing_base_and_bad_metadata_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found") as info:
        PerfBaselines.for_platform(tmp_path, "h200")
    assert info.value.path == str(tmp_path / "perf_baselines.json")
    _write(tmp_path / "perf_baselines.json", {"metadata": {"platform": 200}, "tolerances": {"pr_test": TOL}})
    with pytest.raises(ConfigError) as info:
        PerfBaselines.for_platform(tmp_path, "h200")
    assert info.value.key == "metadata.platform"
    _write(tmp_path / "perf_baselines.json", {"tolerances": {"pr_test": {**TOL, "abs_floor_ms": -1}}})
    with pytest.raises(ConfigError) as info:
        PerfBaselines.for_platform(tmp_path, "h200")
    assert info.value.key == "tolerances.pr_test.abs_floor_ms"


def test_platform_name() -> None:
    import platform

    assert platform_name("cpu") == "cpu_" + platform.machine().lower().replace("-", "_")
    with pytest.raises(ValueError, match="valid: cpu, cuda"):
        platform_name("tpu")
