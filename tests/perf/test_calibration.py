"""The machine factor by hand, readings combined and runs scaled by hand, the probes in a real gloo group."""

from __future__ import annotations

import pytest

from harness.baselines.perf import NORMALISED_PROFILE, PerfBaselines, check_perf
from harness.gate import calibration
from harness.gate.calibration import machine_factor
from harness.ranks import RankPool, rank_device

from .test_perf_stage import REPO

BASE = {"launch_us": 9.2, "module_us": 57.0, "gemm_ms": 0.025, "sdpa_ms": 0.025, "comm_us": 100.0}


def test_the_synthetic_step_sets_the_factor_where_both_sides_have_it() -> None:
    new = {**BASE, "step_ms": 1.3, "module_us": 20.0, "comm_us": 110.0}
    got = machine_factor(new, {**BASE, "step_ms": 1.0})
    assert (got.value, got.how) == (pytest.approx(1.3), "step_ms: parity's synthetic step on this group")
    assert got.ratios["module_us"] == pytest.approx(20.0 / 57.0)
    # a baseline from before the step probe: the largest ratio over the probes both sides have
    old = machine_factor(new, BASE)
    assert (old.value, old.how) == (pytest.approx(1.1), "max over the probes: comm_us (the baseline has no step_ms)")
    with pytest.raises(ValueError, match="no common calibration probe"):
        machine_factor({"launch_us": 1.0}, {"gemm_ms": 1.0})


def test_a_slowdown_the_largest_ratio_let_through_fails_with_the_step_factor() -> None:
    """On an H200 whose host was 35 % faster, the planted slowdown passed against the largest ratio
    (~1.0 from the GPU probes): 40.5 ms against 58 ms × 1.0 × 1.12. A step probe that moves with
    the host catches it; the unchanged tree still passes."""
    baseline = {"expected_e2e_ms": 58.0, "calibration": {**BASE, "step_ms": 1.0}}
    new = {**BASE, "module_us": 57.0 * 0.65, "step_ms": 0.65, "sdpa_ms": 0.0248}
    tolerances = PerfBaselines.load(REPO / "baselines" / "perf_baselines.json").tolerances(NORMALISED_PROFILE, env={})
    unchanged, slowed = {"expected_e2e_ms": 58.0 * 0.65}, {"expected_e2e_ms": 58.0 * 0.65 * 1.2}
    factor = machine_factor(new, baseline["calibration"]).value
    assert all(c.passed for c in check_perf(baseline, unchanged, tolerances, factor=factor))
    assert not any(c.passed for c in check_perf(baseline, slowed, tolerances, factor=factor))
    largest = machine_factor({k: v for k, v in new.items() if k != "step_ms"}, BASE).value
    assert all(c.passed for c in check_perf(baseline, slowed, tolerances, factor=largest))  # what happened before


def test_readings_combine_as_medians_and_scale_each_run_to_the_typical_speed() -> None:
    # before prepare (every probe), before each of 3 runs (the step alone), after the last (every probe)
    readings = [{"module_us": 50.0, "step_ms": 1.0}, {"step_ms": 0.6}, {"step_ms": 1.0}, {"step_ms": 1.2},
                {"module_us": 70.0, "step_ms": 1.4}]
    assert calibration.combine(readings) == {"module_us": 60.0, "step_ms": 1.0}
    # run i lies between readings[1 + i] and readings[2 + i]: 0.8, 1.1 and 1.3 around the runs
    assert calibration.run_scales(readings, 3) == pytest.approx([1 / 0.8, 1 / 1.1, 1 / 1.3])
    assert calibration.run_scales(readings, 2) is None  # readings that do not frame the runs
    assert calibration.run_scales([{"module_us": 1.0}, {"step_ms": 1.0}, {"step_ms": 1.0}], 1) is None


def test_scaled_medians_by_hand() -> None:
    from harness.gate.pipeline_runs import median_scenario
    from harness.targets import Timings

    runs = [Timings(40.0, {"DenoisingStage": 30.0}, [15.0, 15.0], "perf_counter"),
            Timings(60.0, {"DenoisingStage": 48.0}, [24.0, 24.0], "perf_counter"),
            Timings(50.0, {"DenoisingStage": 40.0}, [20.0, 20.0], "perf_counter")]
    # the second run met a host 1.5x slower, the third one 1.25x: scaled, the three runs agree
    got = median_scenario(runs, [1.0, 1 / 1.5, 1 / 1.25])
    assert got["expected_e2e_ms"] == pytest.approx(40.0) and got["stages_ms"]["DenoisingStage"] == pytest.approx(32.0)
    assert got["expected_median_denoise_ms"] == pytest.approx(16.0)
    assert median_scenario(runs)["expected_e2e_ms"] == 50.0
    with pytest.raises(ValueError, match="2 scales for 3 runs"):
        median_scenario(runs, [1.0, 1.0])


def _two_rank_probes() -> dict[str, float]:
    """Rank worker: the probes, read by both ranks at once."""
    return calibration.measure(str(rank_device()))


def test_group_probes_in_a_real_gloo_group() -> None:
    with RankPool(2, timeout=120) as pool:
        readings = pool.run(_two_rank_probes)
    for probes in readings:
        assert set(probes) == set(calibration.PROBES)
        assert 1.0 < probes["comm_us"] < 1e5  # one 64 KiB all-to-all over loopback: microseconds to milliseconds
        # the synthetic step's 8 exchanges cost more than one bare exchange of the probe's size
        assert probes["step_ms"] * 1e3 > probes["comm_us"]
    alone = calibration.measure("cpu")  # no group here: no exchange in the step, no comm probe
    assert set(alone) == set(calibration.PROBES) - {"comm_us"}


def test_a_baseline_naming_an_unknown_probe_is_refused_naming_the_key() -> None:
    from harness.errors import ConfigError

    doc = {"tolerances": {}, "scenarios": {"s": {"expected_e2e_ms": 1.0, "calibration": {"step_m": 1.0}}}}
    with pytest.raises(ConfigError, match="unknown calibration probe 'step_m'") as caught:
        PerfBaselines.from_json(doc, "h200.json")
    assert "h200.json" in str(caught.value) and "scenarios.s.calibration" in str(caught.value)
