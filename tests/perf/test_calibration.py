"""The machine factor by hand, time shares from profiler events by hand and from real profiles, the
all-to-all probe in a real gloo group."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from harness.baselines.perf import NORMALISED_PROFILE, PerfBaselines, check_perf
from harness.errors import ConfigError
from harness.gate import calibration
from harness.gate.calibration import machine_factor
from harness.gate.time_shares import measure_time_shares, shares_from_events
from harness.ranks import RankPool, rank_device

from .test_perf_stage import REPO

BASE = {"launch_us": 9.2, "module_us": 57.0, "gemm_ms": 0.025, "sdpa_ms": 0.025, "comm_us": 100.0}


def test_shares_weight_each_part_by_its_own_probe() -> None:
    # host 35% faster, device as fast, comm 10% slower (the shape of a fourth H200 against the first)
    new = {"launch_us": 9.0, "module_us": 57.0 * 0.65, "gemm_ms": 0.025, "sdpa_ms": 0.0245, "comm_us": 110.0}
    got = machine_factor(new, BASE, {"host": 0.6, "device": 0.1, "comm": 0.3})
    assert got.value == pytest.approx(0.6 * 0.65 + 0.1 * 1.0 + 0.3 * 1.1)
    assert got.how == "host 60% × 0.65 + device 10% × 1 + comm 30% × 1.1"
    assert got.ratios["module_us"] == pytest.approx(0.65)
    # without shares: the largest ratio (here comm), as before
    plain = machine_factor(new, BASE)
    assert (plain.value, plain.how) == (pytest.approx(1.1), "max over the probes: comm_us")


def test_a_slowdown_the_largest_ratio_let_through_fails_with_shares() -> None:
    """On an H200 whose host was 35 % faster, the planted slowdown passed against the largest ratio
    (~1.0): 40.5 ms against 58 ms × 1.0 × 1.12. With the host-bound scenario's shares it fails."""
    baseline = {"expected_e2e_ms": 58.0, "calibration": BASE, "time_shares": {"host": 0.97, "device": 0.03, "comm": 0.0}}
    new = {**BASE, "module_us": 57.0 * 0.65}
    tolerances = PerfBaselines.load(REPO / "baselines" / "perf_baselines.json").tolerances(NORMALISED_PROFILE, env={})
    unchanged, slowed = {"expected_e2e_ms": 58.0 * 0.64}, {"expected_e2e_ms": 58.0 * 0.64 * 1.2}
    factor = machine_factor(new, BASE, baseline["time_shares"]).value
    assert factor == pytest.approx(0.97 * 0.65 + 0.03)
    assert all(c.passed for c in check_perf(baseline, unchanged, tolerances, factor=factor))
    assert not any(c.passed for c in check_perf(baseline, slowed, tolerances, factor=factor))
    largest = machine_factor(new, BASE).value
    assert all(c.passed for c in check_perf(baseline, slowed, tolerances, factor=largest))  # what happened before


def test_on_a_cpu_the_host_part_follows_its_arithmetic_too() -> None:
    new = {**BASE, "module_us": 57.0 * 0.9, "gemm_ms": 0.025 * 1.2}
    got = machine_factor(new, BASE, {"host": 1.0, "device": 0.0, "comm": 0.0}, device_type="cpu")
    assert (got.value, got.how) == (pytest.approx(1.2), "host 100% × 1.2")
    on_gpu = machine_factor(new, BASE, {"host": 1.0, "device": 0.0, "comm": 0.0}, device_type="cuda")
    assert on_gpu.value == pytest.approx(0.9)  # there the host's part is launch and Python overhead


def test_shares_that_need_a_probe_one_side_lacks_fall_back_to_the_largest_ratio() -> None:
    old = {k: v for k, v in BASE.items() if k != "comm_us"}  # a baseline from before comm_us
    got = machine_factor({**BASE, "gemm_ms": 0.03}, old, {"host": 0.5, "device": 0.0, "comm": 0.5})
    assert got.value == pytest.approx(1.2)
    assert got.how == "max over the probes: gemm_ms (the comm share needs comm_us, which one side lacks)"
    # a part with no share needs no probe
    assert machine_factor(BASE, old, {"host": 1.0, "device": 0.0, "comm": 0.0}).how == "host 100% × 1"
    with pytest.raises(ValueError, match="no common calibration probe"):
        machine_factor({"launch_us": 1.0}, {"gemm_ms": 1.0})


def test_shares_from_events_by_hand() -> None:
    events = [
        ("aten::linear", 0.0, 100.0),
        ("c10d::alltoall_base_", 100.0, 110.0),
        ("gloo:all_to_all", 105.0, 150.0),          # overlaps the c10d op: counted once, 100..150
        ("cudaStreamSynchronize", 140.0, 160.0),    # half inside comm: only 150..160 is device wait
        ("cudaMemcpyAsync", 200.0, 210.0),
        ("cudaLaunchKernel", 210.0, 215.0),         # a launch is host work
        ("nccl:all_reduce", 300.0, 320.0),
    ]
    got = shares_from_events(events, wall_us=1000.0)
    assert got == pytest.approx({"host": 1 - 0.07 - 0.02, "device": 0.02, "comm": 0.07})
    # a profile that found more waiting than the unprofiled run lasted: no host time, the rest in proportion
    assert shares_from_events([("gloo:x", 0.0, 30.0), ("cudaDeviceSynchronize", 30.0, 40.0)], wall_us=20.0) == \
        pytest.approx({"host": 0.0, "device": 0.25, "comm": 0.75})


def test_a_real_profile_of_host_work_is_all_host_and_prints_no_kineto_lines(capfd: pytest.CaptureFixture[str]) -> None:
    calls = []

    def run() -> None:
        calls.append(1)
        x = torch.randn(64, 64)
        for _ in range(20):
            x = torch.tanh(x @ x)

    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    shares, why = measure_time_shares(run, wall, "cpu")
    assert why is None and shares == {"host": 1.0, "device": 0.0, "comm": 0.0} and len(calls) == 2
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "USDT" not in err


def test_the_targets_own_error_propagates_from_a_profiled_run() -> None:
    def run() -> None:
        raise RuntimeError("the target broke")

    with pytest.raises(RuntimeError, match="the target broke"):
        measure_time_shares(run, 0.1, "cpu")
    calls = []
    assert measure_time_shares(lambda: calls.append(1), 0.0, "cpu") == (None, "no unprofiled wall time to share out")
    assert calls == [1]  # run anyway: ranks that run collectives together must stay in step


def _two_rank_probe_and_shares() -> tuple[dict[str, float], dict[str, float] | None]:
    """Rank worker: the probes, read by both ranks at once, then the shares of a run that is half all-to-alls."""
    device = str(rank_device())
    probes = calibration.measure(device)
    x = torch.randn(4096, 64)

    def run() -> None:
        for _ in range(10):
            y = torch.tanh(x @ x.T @ x)
            out = torch.empty_like(y)
            dist.all_to_all_single(out, y)

    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    shares, _ = measure_time_shares(run, wall, device)
    return probes, shares


def test_group_probes_and_comm_share_in_a_real_gloo_group() -> None:
    with RankPool(2, timeout=120) as pool:
        results = pool.run(_two_rank_probe_and_shares)
    for probes, shares in results:
        assert set(probes) == set(calibration.PROBES)
        assert 1.0 < probes["comm_us"] < 1e5  # one 64 KiB all-to-all over loopback: microseconds to milliseconds
        # the synthetic step's 8 exchanges make it slower than 8 bare all-to-alls of its probe size would be alone
        assert probes["step_ms"] * 1e3 > probes["comm_us"]
        assert shares is not None and sum(shares.values()) == pytest.approx(1.0)
        assert shares["comm"] > 0.01 and shares["host"] > 0.1 and shares["device"] == 0.0


def test_baseline_time_shares_are_validated_naming_the_key() -> None:
    doc = {"tolerances": {}, "scenarios": {"s": {"expected_e2e_ms": 1.0, "time_shares": {"host": 0.5, "comm": 0.5}}}}
    assert PerfBaselines.from_json(doc).scenario("s")["time_shares"] == {"host": 0.5, "comm": 0.5}  # type: ignore[index]
    for shares, message in (({"hots": 1.0}, "unknown time share 'hots'"), ({"host": 0.5, "comm": 0.3}, "sum to 0.8, not 1"),
                            ({"host": 1.5, "comm": -0.5}, "above the maximum 1.0"), ([0.5, 0.5], "object")):
        doc["scenarios"]["s"]["time_shares"] = shares
        with pytest.raises(ConfigError, match=message) as caught:
            PerfBaselines.from_json(doc, "f.json")
        assert "f.json" in str(caught.value) and "scenarios.s.time_shares" in str(caught.value)
