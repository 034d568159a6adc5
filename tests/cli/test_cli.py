"""The parity command line: exit codes, JSON/JUnit outputs, bad case files, doctor and list."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from harness.cli import main

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
SGLANG_CASES = """
[defaults]
world_size = 2
tokens_per_rank = 64
heads = 30
head_dim = 128
replicated = 6
dtype = "bf16"

[cases.sglang_suffix_w2]
contract = "usp.replicated_suffix_bitwise"

[cases.sglang_prefix_w2]
contract = "usp.replicated_prefix_drift"
"""


@pytest.fixture
def sglang_cases(tmp_path: Path) -> Path:
    (tmp_path / "contracts").mkdir()
    (tmp_path / "contracts" / "sglang.toml").write_text(SGLANG_CASES)
    return tmp_path


def test_help_explains_every_verb(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert [verb for verb in ("init", "list", "check", "gate", "doctor") if f"\n    {verb} " not in text] == []
    assert "exit codes: 0 all passed, 1 any failure, 2 usage or configuration error" in text


def test_usage_errors_exit_2(capsys):
    assert main(["check", "--device", "tpu"]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["check", "--dtype", "fp8"]) == 2
    assert "unknown dtype 'fp8'" in capsys.readouterr().err


def test_unknown_ids_targets_and_world_sizes_exit_2(capsys, sglang_cases):
    assert main(["check", "usp.nope", "--cases", str(sglang_cases)]) == 2
    assert "no case matches 'usp.nope'" in capsys.readouterr().err
    assert main(["check", "--cases", str(sglang_cases), "--world-size", "3"]) == 2
    assert "no selected case runs at world size 3" in capsys.readouterr().err
    assert main(["check", "--cases", str(sglang_cases), "--target", "nosuchmodule:factory"]) == 2
    assert "cannot import module 'nosuchmodule'" in capsys.readouterr().err
    assert main(["check", "--cases", str(sglang_cases), "--target", "yunchang2"]) == 2
    assert "built-in targets: reference, sglang, yunchang, yunchang-ulysses" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,key",
    [
        ('[cases.bad]\ncontract = "usp.nope"\nworld_size = 2\n', "cases.bad.contract"),
        ('[cases.bad]\ncontract = "usp.ulysses_parity"\nworld_size = 2.5\n', "cases.bad.world_size"),
        ('[cases.bad]\ncontract = "usp.ulysses_parity"\n', "cases.bad.world_size"),
        ('[cases.bad]\ncontract = "usp.ulysses_parity"\nworld_size = 4\ntokens = 18\n', "cases.bad.tokens"),
        ('[cases.bad]\ncontract = "usp.ulysses_parity"\nworld_size = 4\nheads = 6\n', "cases.bad.heads"),
    ],
    ids=["unknown-contract", "wrong-type", "missing-key", "tokens-not-divisible", "heads-not-divisible"],
)
@pytest.mark.parametrize("verb", ["check", "gate", "list"])
def test_bad_case_files_exit_2_naming_file_and_key(tmp_path, capsys, text, key, verb):
    (tmp_path / "bad.toml").write_text(text)
    assert main([verb, "--cases", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "bad.toml") in err and f"key '{key}'" in err and "case 'bad'" in err


def test_doctor_json_names_every_backend_and_why():
    # A real subprocess through the console script: what a user runs.
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", "doctor", "--json", "-"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,  # a hang guard: torch's import alone took a minute on a loaded box
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["torch"] and data["python"]
    assert data["platform"]["kind"] == "cpu" and data["platform"]["simulated"] is False
    backends = {b["name"]: b for b in data["backends"]}
    assert set(backends) == {"torch_sdpa", "fa", "sage_attn", "math"}
    assert backends["torch_sdpa"]["available"] and backends["math"]["available"]
    assert not backends["fa"]["available"] and "flash-attn" in backends["fa"]["reason"]
    assert not backends["sage_attn"]["available"] and "sageattention" in backends["sage_attn"]["reason"]
    assert backends["sage_attn"]["returns_lse"] is False and backends["math"]["returns_lse"] is True
    assert {t["name"] for t in data["targets"]} == {
        "reference",
        "yunchang",
        "yunchang-ulysses",
        "xdit",
        "diffusers",
        "sglang",
    }


def test_doctor_reports_a_forced_platform(capsys, monkeypatch):
    monkeypatch.setenv("PARITY_PLATFORM", "rocm:gfx950")
    assert main(["doctor", "--json", "-"]) == 0
    platform = json.loads(capsys.readouterr().out)["platform"]
    assert platform == {
        **platform,
        "kind": "rocm",
        "gcn_arch": "gfx950",
        "simulated": True,
        "label": "rocm:gfx950 (simulated)",
    }


def test_list_json_has_contracts_cases_and_targets(capsys):
    assert main(["list", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    ids = {c["id"] for c in data["contracts"]}
    assert {"usp.replicated_suffix_bitwise", "usp.ring_admission", "backend.selection_precedence"} <= ids
    assert any(c["id"] == "sglang_suffix_w2" for c in data["cases"])
    yunchang = next(t for t in data["targets"] if t["name"] == "yunchang")
    assert "replicated_suffix" not in yunchang["capabilities"] and yunchang["unavailable_on_cpu"]


def test_check_json_and_junit_carry_the_figures_of_every_case(tmp_path, sglang_cases, capsys):
    report, junit = tmp_path / "r.json", tmp_path / "j.xml"
    code = main(
        [
            "check",
            "usp.replicated_suffix_bitwise",
            "usp.replicated_prefix_drift",
            "--cases",
            str(sglang_cases),
            "--json",
            str(report),
            "--junit",
            str(junit),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 passed, 0 failed, 0 skipped" in out
    data = json.loads(report.read_text())
    stage = data["stages"]["contracts"]
    assert (
        stage["summary"]
        == {"passed": 2, "failed": 0, "skipped": 0, "xfailed": 0, "inconclusive": 0, "not_applicable": 0}
        and data["target"] == "reference"
    )
    assert data["command"] == "check" and data["passed"] is True
    by_case = {v["case_id"]: v for v in stage["records"]}
    assert set(by_case) == {"sglang_suffix_w2", "sglang_prefix_w2"}
    for verdict in by_case.values():  # one result: the two records of one check run
        assert {"bitwise", "max_abs", "mean_abs", "rel_err"} <= set(verdict["figures"])
        assert verdict["bound"] and verdict["kernel"] and verdict["duration_s"] > 0
    assert by_case["sglang_suffix_w2"]["figures"]["bitwise"] is True
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("tests") == "2" and suite.get("failures") == "0"


def test_rotating_suffix_target_fails_the_suffix_contract_only(tmp_path, sglang_cases, capsys):
    report, junit = tmp_path / "r.json", tmp_path / "j.xml"
    code = main(
        [
            "check",
            "usp.replicated_suffix_bitwise",
            "usp.replicated_prefix_drift",
            "--cases",
            str(sglang_cases),
            "--target",
            "tests.targets.rotating_suffix:factory",
            "--json",
            str(report),
            "--junit",
            str(junit),
        ]
    )
    assert code == 1
    assert "1 passed, 1 failed, 0 skipped" in capsys.readouterr().out
    by_case = {v["case_id"]: v for v in json.loads(report.read_text())["stages"]["contracts"]["records"]}
    suffix = by_case["sglang_suffix_w2"]
    assert suffix["status"] == "failed" and suffix["figures"]["bitwise"] is False and suffix["figures"]["max_abs"] > 0
    assert by_case["sglang_prefix_w2"]["status"] == "passed"
    failure = ET.parse(junit).getroot().find(".//testcase[@name='sglang_suffix_w2']/failure")
    assert failure is not None and failure.get("message").startswith("not bitwise")


def test_gate_writes_results_and_junit_into_the_report_dir(tmp_path, capsys):
    cases = tmp_path / "cases"
    (cases / "contracts").mkdir(parents=True)
    (cases / "contracts" / "one.toml").write_text(
        '[cases.precedence]\ncontract = "backend.selection_precedence"\n'
        '[cases.admission]\ncontract = "usp.ring_admission"\nworld_size = 2\n'
    )
    (
        cases / "contracts" / "targets"
    ).mkdir()  # the admission case's no-LSE backend is sage_attn: pinned where it is missing
    (cases / "contracts" / "targets" / "reference.toml").write_text(
        '[expected_skips."admission"]\nbecause = "sage_attn is optional"\nwhen_missing = "sageattention"\n'
    )
    report = tmp_path / "report"
    assert main(["gate", "--cases", str(cases), "--report", str(report)]) == 0
    assert "gate: PASSED" in capsys.readouterr().out
    data = json.loads((report / "results.json").read_text())
    assert data["passed"] is True
    stage = data["stages"]["contracts"]
    assert stage["summary"] == {
        "passed": 1,
        "failed": 0,
        "skipped": 1,
        "xfailed": 0,
        "inconclusive": 0,
        "not_applicable": 0,
    }
    assert ET.parse(report / "junit.xml").getroot().find("testsuite").get("name") == "contracts"
    assert main(["gate", "--cases", str(cases), "--baselines", str(tmp_path / "missing")]) == 2


def test_ids_after_options_are_ids_and_a_stray_option_is_the_verbs_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 39: `parity perf BASE HEAD --max-pairs 12 CASE` gave the top-level usage error."""
    from harness.cli import build_parser, parse

    parser = build_parser()
    args = parse(parser, ["perf", "reference", "reference", "--max-pairs", "12", "zimage_t2i_1rank", "other"])
    assert (args.base, args.head, args.ids, args.max_pairs) == (
        "reference",
        "reference",
        ["zimage_t2i_1rank", "other"],
        12,
    )
    assert parse(parser, ["check", "a", "--world-size", "2", "b"]).ids == ["a", "b"]
    assert main(["check", "usp.ring_parity", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "parity check: error: unrecognized arguments: --bogus" in err and "usage: parity check" in err
    assert main(["doctor", "extra"]) == 2
    assert "parity doctor: error: unrecognized arguments: extra" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine where torch sees no CUDA device")
@pytest.mark.parametrize(
    "argv",
    [["check"], ["sweep"], ["bless", "zimage_t2i_1rank", "--dry-run"], ["gate"], ["perf", "reference", "reference"]],
    ids=["check", "sweep", "bless", "gate", "perf"],
)
def test_every_verb_that_runs_refuses_a_cuda_device_torch_cannot_see(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--device", "cuda"]) == 2
    assert "key '--device': --device cuda but torch sees no CUDA device" in capsys.readouterr().err
