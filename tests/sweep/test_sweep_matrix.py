"""Sweeps over a real 2-rank group, and the merged matrix."""

from __future__ import annotations

import json

import pytest

from harness.cases import load_cases
from harness.contracts.runner import RunOptions
from harness.errors import ConfigError
from harness.paths import default_cases_dir
from harness.sweep import BackendColumn, SweepOptions, default_backends, expand_matrix, run_sweep
from harness.sweep.matrix import load_sweep, render_html, render_markdown

pytestmark = pytest.mark.timeout(240)


def _suffix_cases():
    """The Ulysses suffix cases (bitwise); the ring ones are judged by the FlashAttention rule."""
    return [
        c
        for c in load_cases(default_cases_dir())
        if c.contract_id == "usp.replicated_suffix_bitwise" and c.params.get("ring_degree", 1) == 1
    ]


def test_backend_columns():
    assert str(BackendColumn.parse("torch_sdpa:flash")) == "torch_sdpa:flash"
    assert BackendColumn.parse("math") == BackendColumn("math")
    cuda = {str(c) for c in default_backends(RunOptions(device="cuda"))}
    assert {"torch_sdpa:flash", "torch_sdpa:cudnn", "fa", "math"} <= cuda
    assert not any(":" in str(c) for c in default_backends(RunOptions()))


def test_matrix_expansion_drops_duplicates_and_contracts_without_backend():
    cases = load_cases(default_cases_dir())
    cells = expand_matrix(cases, [BackendColumn("math")], ["bf16"], [2])
    assert cells and all(c.params["dtype"] == "bf16" and c.params["backend"] == "math" for c, _ in cells)
    keys = [json.dumps([c.contract_id, dict(c.params)], sort_keys=True) for c, _ in cells]
    assert len(keys) == len(set(keys))
    assert all(c.world_size == 2 for c, _ in cells)


@pytest.fixture(scope="module")
def sweep_files(tmp_path_factory):
    """One real sweep, and the same run with the ROCm branches simulated."""
    out = tmp_path_factory.mktemp("sweeps")
    cases = _suffix_cases()
    columns = [BackendColumn("torch_sdpa"), BackendColumn("fa")]
    real = run_sweep(cases, SweepOptions(backends=tuple(columns), dtypes=("bf16",), world_sizes=(2,), kernels=False))
    (out / "cpu.json").write_text(json.dumps(real))
    mp = pytest.MonkeyPatch()
    mp.setenv("PARITY_PLATFORM", "rocm:gfx950")
    try:
        simulated = run_sweep(
            cases, SweepOptions(backends=tuple(columns[:1]), dtypes=("bf16",), world_sizes=(2,), kernels=False)
        )
    finally:
        mp.undo()
    (out / "rocm.json").write_text(json.dumps(simulated))
    return out / "cpu.json", out / "rocm.json"


def test_sweep_records_platform_and_cells(sweep_files):
    doc = json.loads(sweep_files[0].read_text())
    assert doc["platform"]["kind"] == "cpu" and doc["platform"]["torch"]
    statuses = {(c["backend"], c["status"]) for c in doc["cells"]}
    assert ("torch_sdpa", "passed") in statuses and ("fa", "skipped") in statuses
    skipped = next(c for c in doc["cells"] if c["backend"] == "fa")
    assert "flash-attn" in skipped["reason"]
    sdpa = next(c for c in doc["cells"] if c["backend"] == "torch_sdpa")
    assert sdpa["figures"]["bitwise"] is True


def test_simulated_platform_is_labelled(sweep_files):
    doc = json.loads(sweep_files[1].read_text())
    assert doc["platform"]["simulated"] is True and doc["platform"]["gcn_arch"] == "gfx950"


def test_matrix_merges_machines(sweep_files):
    sweeps = [load_sweep(p) for p in sweep_files]
    text = render_markdown(sweeps)
    header = text.splitlines()[0]
    assert "rocm:gfx950 (simulated) / torch_sdpa" in header and "cpu" in header
    row = next(line for line in text.splitlines() if line.startswith("| usp.replicated_suffix_bitwise · bf16"))
    assert "pass =" in row and "skip" in row
    html = render_html(sweeps)
    assert "<table>" in html and 'class="pass"' in html and 'class="skip"' in html


def test_failed_cells_are_shown_first():
    sweep_doc = {
        "schema": "parity.sweep/1",
        "platform": {"kind": "cpu", "label": "cpu", "device_name": "x"},
        "cells": [
            {"contract": "c", "dtype": "bf16", "backend": "math", "status": "passed", "figures": {"bitwise": True}},
            {"contract": "c", "dtype": "bf16", "backend": "math", "status": "failed", "figures": {"max_abs": 0.5}},
        ],
    }
    from harness.sweep.matrix import Sweep

    sweep = Sweep("mem", sweep_doc["platform"], sweep_doc["cells"], [], {})
    assert "FAIL 5.00e-01 (+1)" in render_markdown([sweep])


@pytest.mark.parametrize(
    ("status", "figures", "text"),
    [
        ("xfailed", {"max_abs": 0.1}, "xfail 1.00e-01"),
        ("failed", {"max_abs": "inf"}, "FAIL inf"),
    ],
    ids=["xfailed", "failed-inf"],
)
def test_an_expected_failure_reads_as_one_and_a_non_finite_error_is_spelled_out(status, figures, text):
    from harness.sweep.matrix import Sweep

    platform = {"kind": "cpu", "label": "cpu", "device_name": "x"}
    cells = [{"contract": "c", "dtype": "bf16", "backend": "math", "status": status, "figures": figures}]
    assert text in render_markdown([Sweep("mem", platform, cells, [], {})])


@pytest.mark.parametrize(
    "content, key",
    [
        ("{", None),
        ('{"schema": "other"}', "schema"),
        ('{"schema": "parity.sweep/1", "platform": {}, "cells": [{}]}', "cells.0.contract"),
        ('{"schema": "parity.sweep/1", "platform": {}, "cells": [], "kernal": []}', "did you mean 'kernels'"),
        ('{"schema": "parity.sweep/1", "platform": {"devce_name": "x"}, "cells": []}', "key 'platform.devce_name'"),
        (
            '{"schema": "parity.sweep/1", "platform": {}, "cells": [{"contract": "c", "dtype": "bf16", "backend": "math", '
            '"status": "passed", "figure": {"max_abs": 9}}]}',
            "key 'cells.0.figure': unknown key: did you mean 'figures'",
        ),
        (
            '{"schema": "parity.sweep/1", "platform": {}, "cells": [], "kernels": [{"backend": "m", "dtype": "bf16", '
            '"shape": "s", "median": 1}]}',
            "key 'kernels.0.median'",
        ),
    ],
    ids=[
        "not_json",
        "other_schema",
        "cell_without_contract",
        "misspelt_top_level",
        "misspelt_platform_key",
        "misspelt_cell_key",
        "misspelt_kernel_key",
    ],
)
def test_bad_sweep_files_name_file_and_key(tmp_path, content, key):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_sweep(path)
    assert str(path) in str(info.value)
    if key:
        assert key in str(info.value)
