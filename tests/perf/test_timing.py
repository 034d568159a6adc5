"""Timing of image cases: medians by hand, peak memory that really resets, SP cases timed on their ranks by sessions."""

from __future__ import annotations

import sys

import pytest

from harness.baselines.perf import Tolerances, check_perf, validate_scenario
from harness.cases.image import load_image_case_file
from harness.perf import absolute
from harness.perf.figures import WALL, run_figures
from harness.pipelines.sessions import Session, TimedRun, _peak_memory_bytes, _reset_peak_memory
from harness.ranks import PoolSet
from harness.targets import Timings

ZERO = Tolerances(e2e=0.0, denoise_stage=0.0, non_denoise_stage=0.0, denoise_step=0.0, denoise_agg=0.0)


def _run(text: float, steps: tuple[float, ...], decode: float, wall: float = 0.0) -> dict[str, float]:
    denoise = sum(steps)
    stages = {"TextEncodingStage": text, "DenoisingStage": denoise, "DecodingStage": decode}
    timings = Timings(text + denoise + decode, stages, list(steps), "perf_counter")
    return run_figures(TimedRun(timings, wall or timings.e2e_ms + 1.0, (), "not_measured"))


def test_a_run_as_figures_by_hand() -> None:
    figures = _run(1.0, (10.0, 20.0, 30.0), 5.0, wall=70.0)
    assert figures == {
        WALL: 70.0,
        "expected_e2e_ms": 66.0,
        "stages_ms.TextEncodingStage": 1.0,
        "stages_ms.DenoisingStage": 60.0,
        "stages_ms.DecodingStage": 5.0,
        "denoise_step_ms.0": 10.0,
        "denoise_step_ms.1": 20.0,
        "denoise_step_ms.2": 30.0,
        "expected_avg_denoise_ms": 20.0,
        "expected_median_denoise_ms": 20.0,
    }


def test_median_of_each_value_by_hand() -> None:
    runs = [_run(1.0, (10.0, 20.0, 30.0), 5.0), _run(3.0, (12.0, 8.0, 40.0), 6.0), _run(2.0, (11.0, 30.0, 20.0), 100.0)]
    got = absolute.median_scenario(runs)
    assert got["stages_ms"] == {"TextEncodingStage": 2.0, "DenoisingStage": 60.0, "DecodingStage": 6.0}
    # step i: median over runs of step i
    assert got["denoise_step_ms"] == {"0": 11.0, "1": 20.0, "2": 30.0}
    # e2e per run: 66, 69, 163 -> 69: the runs' own e2e, not the sum of the stage medians (68)
    assert got["expected_e2e_ms"] == 69.0
    # per run: mean of steps 20, 20, 20.333 -> 20; median of steps 20, 12, 20 -> 20
    assert got["expected_avg_denoise_ms"] == 20.0
    assert got["expected_median_denoise_ms"] == 20.0
    assert WALL not in got  # parity's clock is an extra of the measurement, not a scenario value
    skewed = [_run(1.0, (1.0, 1.0, 10.0), 1.0), _run(1.0, (2.0, 2.0, 2.0), 1.0), _run(1.0, (3.0, 9.0, 3.0), 1.0)]
    got = absolute.median_scenario(skewed)
    assert got["expected_avg_denoise_ms"] == 4.0  # per-run means 4, 2, 5
    assert got["expected_median_denoise_ms"] == 2.0  # per-run medians 1, 2, 3


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ([], "at least one run"),
        ([_run(1.0, (1.0,), 1.0), _run(1.0, (1.0, 2.0), 1.0)], "number of denoising steps"),
    ],
    ids=["no-run", "steps-differ"],
)
def test_median_scenario_refuses(runs: list[dict[str, float]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        absolute.median_scenario(runs)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="peak RSS reset through /proc/self/clear_refs is Linux-only"
)
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


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[TimedRun], dict]]:
    path = tmp_path_factory.mktemp("timing") / "tiny.toml"
    path.write_text(CASES)
    out = {}
    with PoolSet("cpu") as pools:
        for case in load_image_case_file(path):
            with Session(case.pipeline_run, pools) as session:
                runs = [session.run() for _ in range(2)]
                with pytest.raises(ValueError, match="runs >= 1"):
                    absolute.measure(session, runs=0, warmup=0)
                out[case.id] = (runs, absolute.measure(session, runs=2, warmup=1))
    return out


@pytest.mark.parametrize("run_index", [0, 1], ids=["run0", "run1"])
@pytest.mark.parametrize("case_id", ["tiny_2ranks", "tiny_video_1rank"])
def test_a_session_times_its_runs_on_the_cases_ranks(measured: dict, case_id: str, run_index: int) -> None:
    runs, _ = measured[case_id]
    assert len(runs) == 2
    run = runs[run_index]
    ranks = 2 if case_id == "tiny_2ranks" else 1
    assert len(run.peak_memory_bytes) == ranks  # rank 0's clock, every rank's memory
    assert all(b > 50 << 20 for b in run.peak_memory_bytes)  # a rank with torch loaded holds > 50 MB
    t = run.timings
    assert len(t.denoise_step_ms) == 3 and t.clock == "perf_counter" and run.output is None
    # the three stages partition the run: they add up to the end-to-end time (the pipeline's own wall clock) ...
    assert sum(t.stages_ms.values()) == pytest.approx(t.e2e_ms, rel=1e-3)
    assert t.stages_ms["DenoisingStage"] == pytest.approx(sum(t.denoise_step_ms), rel=1e-6)
    assert t.e2e_ms <= run.wall_ms  # ... which parity's clock around the whole call contains


@pytest.mark.parametrize("case_id", ["tiny_2ranks", "tiny_video_1rank"])
def test_a_measurement_is_a_raw_scenario(measured: dict, case_id: str) -> None:
    _, scenario = measured[case_id]
    assert validate_scenario(scenario, "<measured>", "perf") is scenario  # sglang's scenario shape
    assert (scenario["runs"], scenario["warmup"]) == (2, 1)
    samples = scenario["samples"]
    assert len(samples[WALL]) == 2 and scenario["expected_e2e_ms"] == pytest.approx(sum(samples["expected_e2e_ms"]) / 2)
    assert scenario["peak_memory_kind"] == ("rss_peak" if sys.platform.startswith("linux") else "rss_lifetime_peak")
    # a measurement checked against itself passes every value at zero tolerance
    assert all(c.passed for c in check_perf(scenario, scenario, ZERO))
