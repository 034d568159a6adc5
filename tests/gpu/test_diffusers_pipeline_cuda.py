"""The ``diffusers`` pipeline target on CUDA: bless and gate the tiny FluxPipeline on the GPU, W=1 and W=2.

W=2 runs diffusers' own context parallelism (``enable_parallelism``, Ulysses over NCCL, one GPU
per rank) against the 1-rank reference; with fewer than 2 GPUs it is skipped with the target's
reason, and the test checks that reason. Run with ``pytest tests/gpu -s`` to see the figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.results import load_results
from tests.gate_project import gate_project
from tests.targets.tiny_flux import FLUX_CASES, save_tiny_flux

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
pytest.importorskip(
    "diffusers", reason="the diffusers pipeline target needs diffusers (pip install 'parity[diffusers]')"
)


def test_gate_on_cuda_at_one_and_two_ranks(tmp_path: Path) -> None:
    flux = save_tiny_flux(tmp_path / "flux")
    cases, baselines = gate_project(tmp_path, flux=FLUX_CASES)
    common = [
        "--cases",
        str(cases),
        "--baselines",
        str(baselines),
        "--device",
        "cuda",
        "--pipeline-target",
        "diffusers",
        "--pipeline-target-arg",
        f"path={flux}",
    ]
    assert main(["bless", "--all", *common]) == 0
    report = tmp_path / "report"
    assert main(["gate", *common, "--report", str(report), "--perf", "--perf-runs", "3", "--perf-warmup", "1"]) == 0
    doc = load_results(report / "results.json")
    images = {r["case_id"]: r for r in doc["stages"]["images"]["records"]}
    perf = doc["perf"]
    one = images["flux_1rank"]
    assert one["status"] == "passed" and one["figures"]["backends"]["context_parallel"] == "none"
    assert perf["flux_1rank"]["clock"] == "cuda_events (stages), perf_counter (e2e)"
    samples = perf["flux_1rank"][
        "samples"
    ]  # run by run, the stages on the device's timeline fit in the call's wall clock
    stages = [sum(run) for run in zip(*(v for k, v in samples.items() if k.startswith("stages_ms.")))]
    assert all(s <= e2e for s, e2e in zip(stages, samples["expected_e2e_ms"])), (stages, samples["expected_e2e_ms"])
    print(
        f"FIGURE cuda flux_1rank {doc['cases']['flux_1rank']['metrics']} e2e {perf['flux_1rank']['expected_e2e_ms']:.2f} ms "
        f"stages {perf['flux_1rank']['stages_ms']} steps {perf['flux_1rank']['denoise_step_ms']}"
    )
    two = images["flux_2ranks"]
    if torch.cuda.device_count() < 2:
        assert two["status"] == "skipped" and "one GPU per rank" in two["reason"]
        print(f"FIGURE cuda flux_2ranks skipped: {two['reason']}")
        return
    assert two["status"] == "passed" and two["figures"]["backends"]["context_parallel"] == "ulysses=2"
    print(
        f"FIGURE cuda flux_2ranks (CP ulysses=2) {doc['cases']['flux_2ranks']['metrics']} e2e "
        f"{perf['flux_2ranks']['expected_e2e_ms']:.2f} ms stages {perf['flux_2ranks']['stages_ms']}"
    )
