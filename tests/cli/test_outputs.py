"""What people and scripts read from the CLI: --json FILE / -, --version, help text, list, table layout, compare."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from harness.cli import VERBS, build_parser, main
from harness.paths import parity_version
from harness.report.console import CONTRACT_COLUMNS, result_table
from harness.results import PASSED, CaseResult

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)
PRECEDENCE = '[cases.precedence]\ncontract = "backend.selection_precedence"\nworld_size = 1\n'


@pytest.fixture
def one_case(tmp_path: Path) -> Path:
    (tmp_path / "contracts").mkdir()
    (tmp_path / "contracts" / "one.toml").write_text(PRECEDENCE)
    return tmp_path


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"parity {parity_version()}" and parity_version()[0].isdigit()


def test_json_dash_is_stdout_and_the_tables_go_to_stderr(one_case: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--cases", str(one_case), "--json", "-"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # nothing but the document on stdout
    assert doc["command"] == "check" and doc["stages"]["contracts"]["summary"]["passed"] == 1
    assert "contract results" in captured.err and "check: PASSED" in captured.err
    assert doc["parity_version"] == parity_version() and set(doc["git"]) == {"commit", "dirty"}


@pytest.mark.parametrize("verb", ["list", "doctor"])
def test_json_dash_of_a_verb_without_cases_is_its_document(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([verb, "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_json_file_is_written_and_a_case_id_is_not_taken_for_one(
    one_case: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "inventory.json"
    assert main(["list", "--json", str(out)]) == 0
    assert capsys.readouterr().out == "" and "contracts" in json.loads(out.read_text())
    assert main(["check", "--cases", str(one_case), "--json", "sglang_suffix_w2"]) == 2
    err = capsys.readouterr().err
    assert "expected FILE.json, or - for stdout; got 'sglang_suffix_w2'" in err
    assert not Path("sglang_suffix_w2").exists()


def test_every_verb_takes_the_same_json_option() -> None:
    parser = build_parser()
    verbs = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    with_json = sorted(v for v, p in verbs.items() if any("--json" in a.option_strings for a in p._actions))
    assert with_json == sorted(
        set(VERBS) - {"init", "matrix", "recalibrate"}
    )  # matrix renders JSON; init, recalibrate write files
    actions = {verb: next(a for a in verbs[verb]._actions if "--json" in a.option_strings) for verb in with_json}
    odd = {
        verb: (a.metavar, a.required, a.help)
        for verb, a in actions.items()
        if not (a.metavar == "FILE" and not a.required and "- for stdout" in a.help)
    }
    assert not odd, odd


HELP_COMMANDS = [[], *([v] for v in VERBS), ["recalibrate", "thresholds"], ["recalibrate", "perf"]]


@pytest.mark.parametrize("words", HELP_COMMANDS, ids=[" ".join(w) or "parity" for w in HELP_COMMANDS])
def test_help_texts_have_no_docstring_markup(capsys: pytest.CaptureFixture[str], words: list[str]) -> None:
    assert main([*words, "--help"]) == 0
    text = capsys.readouterr().out
    assert not re.search(r"``|:(func|mod|class|meth|data):", text), text


def test_list_shows_contract_cases_image_cases_and_perf_scenarios(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    baselines = tmp_path / "baselines"
    shutil.copytree(REPO / "baselines", baselines)
    overlay = baselines / "platforms" / "perf" / "h200.json"
    overlay.parent.mkdir(parents=True, exist_ok=True)
    overlay.write_text(
        json.dumps({"metadata": {"platform": "h200"}, "scenarios": {"zimage_t2i_1rank": {"expected_e2e_ms": 54.6}}})
    )
    assert main(["list", "--json", "-", "--baselines", str(baselines)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"zimage_t2i_1rank", "hunyuan_t2v_2ranks"} <= {c["id"] for c in data["image_cases"]}
    assert any(p["id"] == "zimage_t2i_1rank" and p["platform"] == "h200" for p in data["perf_scenarios"])
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert f"contract cases ({len(data['cases'])})" in out and "image cases (" in out and "perf scenarios (" in out


def test_readme_case_count_is_the_number_of_default_cases() -> None:
    from harness.cases.contract import load_cases
    from harness.paths import default_cases_dir

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    counts = re.findall(r"(\d+) default cases", readme)
    assert counts and set(counts) == {str(len(load_cases(default_cases_dir())))}


def test_case_ids_never_wrap_at_120_columns() -> None:
    from harness.cases.contract import load_cases
    from harness.paths import default_cases_dir

    ids = [c.id for c in load_cases(default_cases_dir())]
    results = [
        CaseResult(
            i,
            "usp.x",
            PASSED,
            figures={"bitwise": True, "max_abs": 0.0},
            kernel="torch_sdpa (platform default)",
            bound="bitwise (torch.equal with the single-rank reference)",
            params={"world_size": 2},
        )
        for i in ids
    ]
    console = Console(width=120, record=True)
    console.print(result_table(results, "contract results", CONTRACT_COLUMNS))
    lines = console.export_text().splitlines()
    assert max(map(len, lines)) <= 120
    cells = {line.split("│")[1].strip() for line in lines if line.startswith("│")}
    assert set(ids) <= cells  # every id whole on one line


# ------------------------------------------------------------------------------------ compare


def _doc(e2e: float, psnr: float, mad: float, max_abs: float, status: str) -> dict:
    def record(case_id: str, figures: dict, st: str = "passed") -> dict:
        return {"case_id": case_id, "check": "x", "status": st, "figures": figures}

    return {
        "command": "gate",
        "passed": status == "passed",
        "git": {"commit": "abc", "dirty": False},
        "stages": {
            "contracts": {"records": [record("c1", {"bitwise": max_abs == 0, "max_abs": max_abs}, status)]},
            "images": {
                "records": [
                    record("img", {"psnr": psnr, "ssim": 0.99, "mean_abs_diff": mad, "thresholds": {"psnr": 30.0}})
                ]
            },
            "perf": {"records": [record("zimage", {"e2e_ms": e2e, "peak_memory_mb": 512.0})]},
        },
    }


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    base, new = tmp_path / "base.json", tmp_path / "new.json"
    base.write_text(json.dumps(_doc(100.0, 40.0, 0.5, 0.0, "passed")))
    new.write_text(json.dumps(_doc(112.0, 38.0, 0.6, 1e-3, "failed")))
    return base, new


def test_compare_shows_hand_computed_deltas(two_runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    base, new = map(str, two_runs)
    assert main(["compare", base, new]) == 0  # no threshold: a report, not a verdict
    out = capsys.readouterr().out
    # e2e 100 -> 112: +12%; psnr 40 -> 38: -5%; mean_abs_diff 0.5 -> 0.6: +20%; max_abs 0 -> 1e-3: no percentage
    assert [
        text for text in ("+12.00%", "-5.00%", "+20.00%", "n/a", "contracts/c1: passed -> failed") if text not in out
    ] == []
    assert "peak_memory_mb" not in out and "ssim" not in out  # unchanged figures are not shown
    assert "6 figures compared, 4 changed, 4 worse, 0 past a --fail-on threshold; 1 status change(s)" in out
    assert main(["compare", base, new, "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by = {(f["case_id"], f["figure"]): f for f in doc["figures"]}
    assert by[("zimage", "e2e_ms")]["change_pct"] == pytest.approx(12.0) and by[("img", "psnr")]["change_pct"] == -5.0
    assert (
        by[("img", "mean_abs_diff")]["change_pct"] == pytest.approx(20.0)
        and by[("c1", "max_abs")]["change_pct"] is None
    )
    assert by[("img", "psnr")]["worse"] and by[("zimage", "peak_memory_mb")]["change_pct"] == 0.0


@pytest.mark.parametrize(
    "rule,code",
    [
        ("e2e_ms:10", 1),
        ("e2e_ms:15", 0),
        ("e2e_ms:12.5%", 0),
        ("psnr:5", 0),
        ("psnr:4.9", 1),  # -5% is worse for psnr; exactly 5% is not past 5
        ("mean_abs_diff:19", 1),
        ("max_abs:1000", 1),  # from 0: past every threshold
        ("peak_memory_mb:0", 0),
        ("nope:1", 2),
        ("e2e_ms", 2),
        ("e2e_ms:-1", 2),
    ],
)
def test_compare_fail_on_thresholds(two_runs: tuple[Path, Path], rule: str, code: int) -> None:
    assert main(["compare", *map(str, two_runs), "--fail-on", rule]) == code


def test_compare_improvements_never_fail(two_runs: tuple[Path, Path]) -> None:
    base, new = two_runs
    assert (
        main(["compare", str(new), str(base), "--fail-on", "e2e_ms:0", "--fail-on", "psnr:0", "--fail-on", "max_abs:0"])
        == 0
    )
