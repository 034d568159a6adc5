"""The perf calibration on a GPU: every probe read by ranks sharing the GPU (the exchanges staged
through the host), and a timed 2-rank reference case carrying its readings and run scales.

Run on a GPU machine with ``pytest tests/gpu -s`` to see the figures each test prints.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cases.image import load_image_case_file
from harness.gate import calibration
from harness.gate.pipeline_runs import time_case
from harness.ranks import PoolSet, RankPool

pytestmark = pytest.mark.gpu


def _group_probes() -> dict[str, float]:
    return calibration.measure("cuda")


def test_group_probes_on_ranks_sharing_the_gpu() -> None:
    with RankPool(2, timeout=120, device="cuda") as pool:
        readings = pool.run(_group_probes)
    print(f"FIGURE group probes {readings}")
    assert all(set(r) == set(calibration.PROBES) and 1.0 < r["comm_us"] < 1e5 for r in readings)


def test_a_timed_two_rank_case_carries_its_readings(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text('[cases.sp]\nworld_size = 2\nheight = 32\nwidth = 32\nsteps = 3\n')
    [case] = load_image_case_file(path)
    with PoolSet("cuda") as pools:
        measured = time_case(case, pools, runs=3, warmup=1).measured()
    print(f"FIGURE record {measured['calibration']} scales {measured['run_scales']} e2e {measured['runs_e2e_ms']}")
    assert set(measured["calibration"]) == set(calibration.PROBES) and len(measured["run_scales"]) == 3
