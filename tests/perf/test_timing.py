"""Timing of image cases: medians by hand, peak memory that really resets, SP cases timed on their ranks."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from harness.baselines.perf import Tolerances, check_perf, validate_scenario
from harness.cases.image import load_image_case_file
from harness.gate.calibration import PROBES
from harness.gate.pipeline_runs import _peak_memory_bytes, _reset_peak_memory, median_scenario, time_case
from harness.ranks import PoolSet
from harness.targets import Timings

ZERO = Tolerances(e2e=0.0, denoise_stage=0.0, non_denoise_stage=0.0, denoise_step=0.0, denoise_agg=0.0)


def _t(text: float, steps: tuple[float, ...], decode: float) -> Timings:
    denoise = sum(steps)
    stages = {"TextEncodingStage": text, "DenoisingStage": denoise, "DecodingStage": decode}
    return Timings(text + denoise + decode, stages, list(steps), "perf_counter")


def test_median_of_each_value_by_hand() -> None:
    runs = [_t(1.0, (10.0, 20.0, 30.0), 5.0), _t(3.0, (12.0, 8.0, 40.0), 6.0), _t(2.0, (11.0, 30.0, 20.0), 100.0)]
    got = median_scenario(runs)
    assert got["stages_ms"] == {"TextEncodingStage": 2.0, "DenoisingStage": 60.0, "DecodingStage": 6.0}
    # step i: median over runs of step i
    assert got["denoise_step_ms"] == {"0": 11.0, "1": 20.0, "2": 30.0}
    # e2e per run: 66, 69, 163 -> 69: the runs' own e2e, not the sum of the stage medians (68)
    assert got["expected_e2e_ms"] == 69.0
    # per run: mean of steps 20, 20, 20.333 -> 20; median of steps 20, 12, 20 -> 20
    assert got["expected_avg_denoise_ms"] == 20.0
    assert got["expected_median_denoise_ms"] == 20.0
    skewed = [_t(1.0, (1.0, 1.0, 10.0), 1.0), _t(1.0, (2.0, 2.0, 2.0), 1.0), _t(1.0, (3.0, 9.0, 3.0), 1.0)]
    got = median_scenario(skewed)
    assert got["expected_avg_denoise_ms"] == 4.0  # per-run means 4, 2, 5
    assert got["expected_median_denoise_ms"] == 2.0  # per-run medians 1, 2, 3
    with pytest.raises(ValueError, match="number of denoising steps"):
        median_scenario([_t(1.0, (1.0,), 1.0), _t(1.0, (1.0, 2.0), 1.0)])
    with pytest.raises(ValueError, match="at least one run"):
        median_scenario([])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS reset through /proc/self/clear_refs is Linux-only")
def test_peak_rss_resets_and_sees_a_new_allocation() -> None:
    spike = bytearray(b"\x01") * (300 << 20)  # touched pages: 300 MB of RSS
    del spike
    assert _reset_peak_memory("cpu") == "rss_peak"
    after_reset = _peak_memory_bytes("cpu", "rss_peak")
    held = bytearray(b"\x01") * (200 << 20)
    peak = _peak_memory_bytes("cpu", "rss_peak")
    assert peak - after_reset >= 190 << 20  # the new allocation is seen ...
    del held
    _reset_peak_memory("cpu")
    assert _peak_memory_bytes("cpu", "rss_peak") < peak - (150 << 20)  # ... and the old spike is forgotten


CASES = """
[defaults]
height = 16
width = 16
steps = 3

[cases.tiny_2ranks]
world_size = 2

[cases.tiny_video_1rank]
num_frames = 2
"""


@pytest.mark.timeout(300)
def test_cases_are_timed_on_their_ranks(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(CASES)
    sp_case, video_case = load_image_case_file(path)
    with PoolSet("cpu") as pools:
        sp = time_case(sp_case, pools, runs=2, warmup=1)
        video = time_case(video_case, pools, runs=1, warmup=0)
        with pytest.raises(ValueError, match="runs >= 1"):
            time_case(video_case, pools, runs=0)
    assert len(sp.timings) == 2 and len(sp.peak_memory_bytes) == 2  # rank 0's clock, both ranks' memory
    assert len(video.timings) == 1 and len(video.peak_memory_bytes) == 1
    for timing in (sp, video):
        for run in timing.timings:
            assert len(run.denoise_step_ms) == 3 and run.clock == "perf_counter"
            # the three stages partition the run: they add up to the end-to-end time
            assert sum(run.stages_ms.values()) == pytest.approx(run.e2e_ms, rel=1e-6)
            assert run.stages_ms["DenoisingStage"] == pytest.approx(sum(run.denoise_step_ms), rel=1e-6)
        assert all(b > 50 << 20 for b in timing.peak_memory_bytes)  # a rank with torch loaded holds > 50 MB
    measured = sp.measured()
    assert validate_scenario(measured, "<measured>", "perf") is measured  # sglang's scenario shape
    assert (measured["runs"], measured["warmup"], measured["world_size"]) == (2, 1, 2)
    assert measured["peak_memory_mb"] == round(max(sp.peak_memory_bytes) / 2**20, 1)
    assert measured["peak_memory_kind"] == ("rss_peak" if sys.platform.startswith("linux") else "rss_lifetime_peak")
    # the calibration: the group's all-to-all probe (two ranks only), every probe before and after,
    # the synthetic step before each run; each run scaled by the step readings around it
    assert measured["calibration"]["comm_us"] > 0 and "comm_us" not in video.measured()["calibration"]
    readings = measured["calibration_readings"]
    assert [set(r) for r in readings[1:-1]] == [{"step_ms"}] * 2 and set(readings[0]) == set(readings[-1]) == set(PROBES)
    assert measured["calibration"]["step_ms"] == pytest.approx(statistics.median(r["step_ms"] for r in readings))
    assert len(measured["run_scales"]) == 2 and len(measured["runs_e2e_ms"]) == 2
    # a measurement checked against itself passes every value at zero tolerance
    assert all(c.passed for c in check_perf(measured, measured, ZERO))
