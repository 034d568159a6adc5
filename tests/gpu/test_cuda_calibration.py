"""The perf calibration on a GPU: the profiler sees the host wait on the device, the all-to-all probe
stages through the host for ranks sharing the GPU, and a timed reference case carries both.

Run on a GPU machine with ``pytest tests/gpu -s`` to see the figures each test prints.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from harness.cases.image import load_image_case_file
from harness.gate import calibration
from harness.gate.pipeline_runs import time_case
from harness.gate.time_shares import measure_time_shares
from harness.ranks import PoolSet, RankPool

pytestmark = pytest.mark.gpu


def _timed_shares(run) -> dict[str, float]:
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    shares, why = measure_time_shares(run, wall, "cuda")
    assert why is None, why
    print(f"FIGURE shares {shares}")
    return shares


def test_device_bound_work_is_device_share_and_launches_are_host() -> None:
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tiny = torch.zeros(1, device="cuda")

    def device_bound() -> None:
        y = big
        for _ in range(20):
            y = big @ y
        float(y[0, 0])  # the host waits here for the device

    def host_bound() -> None:
        for _ in range(3000):
            tiny.add_(1.0)
        float(tiny[0])

    assert _timed_shares(device_bound)["device"] > 0.7
    assert _timed_shares(host_bound)["host"] > 0.7


def _group_probes() -> dict[str, float]:
    return calibration.measure("cuda")


def test_group_probes_on_ranks_sharing_the_gpu() -> None:
    with RankPool(2, timeout=120, device="cuda") as pool:
        readings = pool.run(_group_probes)
    print(f"FIGURE group probes {readings}")
    assert all(set(r) == set(calibration.PROBES) and 1.0 < r["comm_us"] < 1e5 for r in readings)


def test_a_timed_two_rank_case_carries_its_machine_record(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text('[cases.sp]\nworld_size = 2\nheight = 32\nwidth = 32\nsteps = 3\n')
    [case] = load_image_case_file(path)
    with PoolSet("cuda") as pools:
        measured = time_case(case, pools, runs=2, warmup=1).measured()
    print(f"FIGURE record {measured['calibration']} {measured['time_shares']} e2e {measured['expected_e2e_ms']:.2f} ms")
    assert set(measured["calibration"]) == set(calibration.PROBES)
    assert sum(measured["time_shares"].values()) == pytest.approx(1.0) and measured["time_shares"]["comm"] > 0.0
