"""``parity recalibrate``: the table and the written files carry the policy's hand-computed
numbers; nothing is written without --write; loosening is refused with exit 2 and the list;
corrupt results are refused naming the file; a killed writer leaves the old or the new file."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main

REPO = Path(__file__).resolve().parents[2]
SGLANG_BASE = REPO / "tests" / "data" / "sglang" / "consistency_threshold.json"  # flux_image_t2i: 0.92 / 0.95 / 24 / 8
TOL = {"e2e": 0.3, "denoise_stage": 0.15, "non_denoise_stage": 0.6, "denoise_step": 0.3, "denoise_agg": 0.3}


@pytest.fixture
def baselines(tmp_path: Path) -> Path:
    directory = tmp_path / "baselines"
    directory.mkdir()
    shutil.copy(SGLANG_BASE, directory / "consistency_threshold.json")
    (directory / "perf_baselines.json").write_text(json.dumps({"tolerances": {"pr_test": TOL}}, indent=4))
    return directory


def _metrics(clip: Any, ssim: Any, psnr: Any, mad: Any) -> dict[str, Any]:
    return {"clip": clip, "ssim": ssim, "psnr": psnr, "mean_abs_diff": mad}


def _results(
    path: Path, cases: dict[str, dict[str, Any]], platform: str | None = "h200", perf: dict | None = None
) -> Path:
    doc: dict[str, Any] = {"cases": {cid: {"kind": "image", "passed": True, "metrics": m} for cid, m in cases.items()}}
    if platform is not None:
        doc["platform"] = platform
        doc["device_name"] = {"h200": "NVIDIA H200", "mi300x": "AMD Instinct MI300X"}.get(platform, platform)
    if perf is not None:
        doc["perf"] = perf
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    """Rows of the rich tables in ``text``, keyed by their first two cells."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if len(cells) in (6, 7) and cells[0] not in ("case", "scenario"):  # thresholds, perf (with its spread)
            rows[(cells[0], cells[1])] = cells[2:]
    return rows


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.fixture
def three_runs(tmp_path: Path) -> list[Path]:
    runs = [
        {"flux_image_t2i": _metrics(0.9931, 0.97, 28.4, 2.2)},
        {"flux_image_t2i": _metrics(0.9990, 0.99, "inf", 0.5)},
        {"flux_image_t2i": _metrics(None, 0.98, 35.0, 1.0)},  # clip skipped (no CLIP model): ignored
    ]
    return [_results(tmp_path / f"run{i}" / "results.json", cases) for i, cases in enumerate(runs)]


def test_thresholds_table_by_hand_and_dry_run_writes_nothing(baselines: Path, three_runs: list[Path], capsys) -> None:
    base = baselines / "consistency_threshold.json"
    before = base.read_bytes()
    argv = ["recalibrate", "thresholds", "--baselines", str(baselines), "--results", *map(str, three_runs)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    # worst over the 3 runs -> policy: clip 0.9931-0.02; ssim 0.97-0.04; psnr 28.4-3; mad max(2.2+3, 4)
    assert rows[("flux_image_t2i", "clip")] == ["0.92", "0.9931", "0.9731", "tightens"]
    assert rows[("flux_image_t2i", "ssim")] == ["0.95", "0.97", "0.93", "LOOSENS"]
    assert rows[("flux_image_t2i", "psnr")] == ["24", "28.4", "25.4", "tightens"]
    assert rows[("flux_image_t2i", "mean_abs_diff")] == ["8", "2.2", "5.2", "tightens"]
    assert "4 of 4 values change, 1 loosen" in out
    assert "dry run: nothing written (pass --write); 1 would loosen" in out
    assert base.read_bytes() == before and not base.with_name(base.name + ".bak").exists()


def test_thresholds_write_refuses_loosening_then_writes_with_backup(
    baselines: Path, three_runs: list[Path], capsys
) -> None:
    base = baselines / "consistency_threshold.json"
    before = base.read_bytes()
    argv = ["recalibrate", "thresholds", "--baselines", str(baselines), "--results", *map(str, three_runs), "--write"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "refusing to loosen 1 bound(s) without --allow-loosen; nothing was written" in err
    assert "flux_image_t2i.ssim: 0.95 -> 0.93 (worst 0.97)" in err
    assert base.read_bytes() == before
    assert main([*argv, "--allow-loosen"]) == 0
    assert f"previous kept as {base.name}.bak" in capsys.readouterr().out
    assert base.with_name(base.name + ".bak").read_bytes() == before
    doc = _read(base)
    assert doc["cases"]["flux_image_t2i"] == {
        "clip_threshold": 0.9731,
        "ssim_threshold": 0.93,
        "psnr_threshold": 25.4,
        "mean_abs_diff_threshold": 5.2,
    }
    old = json.loads(before)
    assert doc["_comment"] == old["_comment"] and len(doc["cases"]) == len(old["cases"])  # everything else kept


def test_thresholds_platform_overlay_and_policy_file(
    baselines: Path, three_runs: list[Path], tmp_path: Path, capsys
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text("[ssim]\nmargin = 0.01\n[psnr]\nmargin = 2\ncap = 35\n")
    argv = [
        "recalibrate",
        "thresholds",
        "--baselines",
        str(baselines),
        "--results",
        *map(str, three_runs),
        "--policy",
        str(policy),
        "--platform",
        "h200",
        "--write",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows[("flux_image_t2i", "ssim")] == ["0.95", "0.97", "0.95", "unchanged"]  # min(0.97-0.01, cap 0.95)
    assert rows[("flux_image_t2i", "psnr")] == ["24", "28.4", "26.4", "tightens"]  # 28.4 - 2
    overlay = baselines / "platforms" / "h200.json"
    assert "(new file)" in out
    # only the values that change are written into the overlay; the base is untouched
    assert _read(overlay) == {
        "cases": {"flux_image_t2i": {"clip_threshold": 0.9731, "psnr_threshold": 26.4, "mean_abs_diff_threshold": 5.2}}
    }
    assert _read(baselines / "consistency_threshold.json")["cases"]["flux_image_t2i"]["psnr_threshold"] == 24.0
    # the next recalibration of h200 starts from the overlay: the old column shows its values
    assert main(argv[:-1]) == 0
    assert _rows(capsys.readouterr().out)[("flux_image_t2i", "psnr")] == ["26.4", "28.4", "26.4", "unchanged"]


def test_thresholds_per_platform_and_platform_mismatch(baselines: Path, tmp_path: Path, capsys) -> None:
    h200 = _results(tmp_path / "a.json", {"flux_image_t2i": _metrics(0.999, 0.999, 40.0, 0.1)}, platform="h200")
    mi300 = _results(tmp_path / "b.json", {"flux_image_t2i": _metrics(0.99, 0.999, 27.0, 0.1)}, platform="mi300x")
    argv = ["recalibrate", "thresholds", "--baselines", str(baselines), "--results", str(h200), str(mi300), "--write"]
    assert main([*argv, "--per-platform"]) == 0
    # h200: clip 0.999-0.02, psnr 40-3 capped at 30, mad floored at 4; ssim 0.999-0.04 capped at 0.95 = base
    assert _read(baselines / "platforms" / "h200.json")["cases"]["flux_image_t2i"] == {
        "clip_threshold": 0.979,
        "psnr_threshold": 30.0,
        "mean_abs_diff_threshold": 4.0,
    }
    # mi300x: clip 0.99-0.02; psnr 27-3 = 24 = base, so not written
    assert _read(baselines / "platforms" / "mi300x.json")["cases"]["flux_image_t2i"] == {
        "clip_threshold": 0.97,
        "mean_abs_diff_threshold": 4.0,
    }
    # pooled into the base: the worst machine sets the bound (psnr 27 - 3 = 24: unchanged)
    capsys.readouterr()
    assert main(argv[:-1]) == 0
    assert _rows(capsys.readouterr().out)[("flux_image_t2i", "psnr")] == ["24", "27", "24", "unchanged"]
    # results from one machine cannot go into another machine's overlay
    assert main([*argv, "--platform", "h200"]) == 2
    err = capsys.readouterr().err
    assert str(mi300) in err and "results are from platform 'mi300x', not 'h200'" in err
    assert main([*argv, "--platform", "../h200"]) == 2
    assert "'../h200' is not a normalised platform name" in capsys.readouterr().err
    hostile = _results(tmp_path / "d.json", {"flux_image_t2i": _metrics(0.99, 0.99, 30.0, 1.0)}, platform="../../x")
    assert main(["recalibrate", "perf", "--baselines", str(baselines), "--results", str(hostile), "--write"]) == 2
    assert f"{hostile}: key 'platform': '../../x' is not a normalised platform name" in capsys.readouterr().err
    no_platform = _results(tmp_path / "c.json", {"flux_image_t2i": _metrics(0.99, 0.99, 30.0, 1.0)}, platform=None)
    assert (
        main(
            [
                "recalibrate",
                "thresholds",
                "--baselines",
                str(baselines),
                "--results",
                str(no_platform),
                "--per-platform",
            ]
        )
        == 2
    )
    assert "missing key 'platform'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"cases": {', "malformed JSON at line 1"),
        ('{"cases": {"c": {"kind": "image", "passed": true, "metrics": {"clip": 1}}}}', "key 'cases.c.metrics.ssim'"),
        ('{"cases": {}, "perf": {"s": {"stages_ms": {}}}}', "key 'perf.s': missing required key 'expected_e2e_ms'"),
    ],
)
@pytest.mark.parametrize("what", ["thresholds", "perf"])
def test_corrupt_results_are_refused_with_their_path(
    baselines: Path, tmp_path: Path, three_runs: list[Path], capsys, content: str, message: str, what: str
) -> None:
    bad = tmp_path / "broken" / "results.json"
    bad.parent.mkdir()
    bad.write_text(content)
    before = (baselines / "consistency_threshold.json").read_bytes()
    argv = [
        "recalibrate",
        what,
        "--baselines",
        str(baselines),
        "--results",
        str(three_runs[0]),
        str(bad),
        "--write",
        "--allow-loosen",
        "--platform",
        "h200",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"parity recalibrate: error: {bad}" in err and message in err
    assert (baselines / "consistency_threshold.json").read_bytes() == before
    assert not (baselines / "platforms").exists()


def test_a_missing_baselines_directory_is_refused(tmp_path: Path, three_runs: list[Path], capsys) -> None:
    assert main(["recalibrate", "perf", "--baselines", str(tmp_path / "nope"), "--results", str(three_runs[0])]) == 2
    assert "no such baselines directory" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- perf


def _measured(e2e: float, text: float, denoise: float, decode: float, steps: list[float]) -> dict[str, Any]:
    ordered = sorted(steps)
    return {
        "expected_e2e_ms": e2e,
        "stages_ms": {"TextEncodingStage": text, "DenoisingStage": denoise, "DecodingStage": decode},
        "denoise_step_ms": {str(i): s for i, s in enumerate(steps)},
        "expected_avg_denoise_ms": sum(steps) / len(steps),
        "expected_median_denoise_ms": (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2,
        "peak_memory_mb": 123.0,  # extra keys ride along in results, never into baselines
    }


def _perf_runs(tmp_path: Path, platform: str, measurements: list[dict[str, Any]], tag: str = "") -> list[Path]:
    return [
        _results(tmp_path / f"{platform}{tag}{i}.json", {}, platform=platform, perf={"zimage_t2i_1rank": m})
        for i, m in enumerate(measurements)
    ]


def test_perf_creates_the_machine_overlay_from_medians(baselines: Path, tmp_path: Path, capsys) -> None:
    runs = _perf_runs(
        tmp_path,
        "h200",
        [
            _measured(20.123456, 1.11111, 15.5, 3.3, [3.0, 4.0]),
            _measured(22.0, 1.2, 16.0, 3.4, [3.5, 4.5]),
            _measured(23.0, 1.3, 16.5, 3.5, [3.6, 4.6]),
        ],
    )
    argv = ["recalibrate", "perf", "--baselines", str(baselines), "--results", *map(str, runs)]
    assert main(argv) == 0
    rows = _rows(capsys.readouterr().out)
    # the spread: the largest distance of a run from the median, (22 - 20.123456) / 22 and (1.3 - 1.2) / 1.2
    assert rows[("zimage_t2i_1rank", "expected_e2e_ms")] == ["-", "22", "22", "±8.5%", "added"]
    assert rows[("zimage_t2i_1rank", "stages_ms.TextEncodingStage")] == ["-", "1.2", "1.2", "±8.3%", "added"]
    overlay = baselines / "platforms" / "perf" / "h200.json"
    assert not overlay.exists()  # dry run
    assert main([*argv, "--write"]) == 0
    assert "(new file)" in capsys.readouterr().out
    doc = _read(overlay)
    assert doc["metadata"] == {"hardware": "NVIDIA H200", "platform": "h200", "written_by": "parity recalibrate perf"}
    assert doc["scenarios"]["zimage_t2i_1rank"] == {
        "expected_e2e_ms": 22.0,
        "stages_ms": {"TextEncodingStage": 1.2, "DenoisingStage": 16.0, "DecodingStage": 3.4},
        "denoise_step_ms": {"0": 3.5, "1": 4.5},
        "expected_avg_denoise_ms": 4.0,  # medians of 3.5, 4.0, 4.1
        "expected_median_denoise_ms": 4.0,
        "dispersion": {
            "expected_e2e_ms": 0.085,
            "stages_ms.TextEncodingStage": 0.083,
            "stages_ms.DenoisingStage": 0.031,
            "stages_ms.DecodingStage": 0.029,
            "denoise_step_ms.0": 0.143,
            "denoise_step_ms.1": 0.111,
            "expected_avg_denoise_ms": 0.125,
            "expected_median_denoise_ms": 0.125,
        },
    }
    assert "tolerances" not in doc  # the overlay holds this machine's numbers; tolerances stay in the base


def test_perf_refuses_a_tolerance_inside_the_measured_noise(baselines: Path, tmp_path: Path, capsys) -> None:
    """One gate of three read 40 ms where the others read 20-22: a tolerance that cannot hold this machine's
    noise (this file gives e2e 30 %), so the baseline is not written (exit 2), and the table marks the values it could not hold."""
    runs = _perf_runs(
        tmp_path,
        "h200",
        [
            _measured(20.1, 1.1, 15.5, 3.3, [3.0, 4.0]),
            _measured(22.0, 1.2, 16.0, 3.4, [3.5, 4.5]),
            _measured(40.0, 5.0, 30.0, 5.0, [9.0, 9.0]),
        ],
    )
    argv = ["recalibrate", "perf", "--baselines", str(baselines), "--results", *map(str, runs)]
    assert main(argv) == 0  # a dry run shows it
    assert _rows(capsys.readouterr().out)[("zimage_t2i_1rank", "expected_e2e_ms")] == [
        "-",
        "22",
        "22",
        "±81.8% ≥ tol 30%",
        "added",
    ]
    assert main([*argv, "--write"]) == 2
    err = capsys.readouterr().err
    assert (
        "inside the measured noise" in err
        and "zimage_t2i_1rank.expected_e2e_ms: - -> 22 (median 22): runs spread ±81.8%, tolerance 30.0%"
        in " ".join(err.split())
    )
    assert not (baselines / "platforms" / "perf" / "h200.json").exists()


def test_perf_margin_rounding_loosening_and_machines(baselines: Path, tmp_path: Path, capsys) -> None:
    overlay = baselines / "platforms" / "perf" / "h200.json"
    overlay.parent.mkdir(parents=True)
    baseline = _measured(100.0, 10.0, 80.0, 10.0, [40.0, 40.0])
    del baseline["peak_memory_mb"]
    overlay.write_text(
        json.dumps({"metadata": {"platform": "h200"}, "scenarios": {"zimage_t2i_1rank": baseline}}, indent=4)
    )
    before = overlay.read_bytes()
    # within tolerance/3 everywhere (e2e 0.3/3 = 10 %: 109.9 stays; denoise stage 0.15/3 = 5 %: 83.9 stays)
    quiet = _perf_runs(tmp_path, "h200", [_measured(109.9, 10.5, 83.9, 10.2, [40.5, 41.0])])
    argv = ["recalibrate", "perf", "--baselines", str(baselines), "--write"]
    assert main([*argv, "--results", *map(str, quiet)]) == 0
    assert f"{overlay}: unchanged, not rewritten" in capsys.readouterr().out
    assert overlay.read_bytes() == before
    # slower beyond tolerance/3: refused without --allow-loosen, and the file is untouched
    slow = _perf_runs(tmp_path, "h200", [_measured(123.456789, 10.0, 80.0, 10.0, [40.0, 40.0])], tag="slow")
    assert main([*argv, "--results", *map(str, slow)]) == 2
    assert "zimage_t2i_1rank.expected_e2e_ms: 100 -> 123.5 (median 123.457)" in capsys.readouterr().err
    assert overlay.read_bytes() == before
    # faster beyond tolerance/3 tightens without permission; 4 significant figures; .bak kept
    fast = _perf_runs(tmp_path, "h200", [_measured(61.23456, 10.0, 70.00049, 10.0, [40.0, 40.0])], tag="fast")
    assert main([*argv, "--results", *map(str, fast)]) == 0
    scenario = _read(overlay)["scenarios"]["zimage_t2i_1rank"]
    assert (scenario["expected_e2e_ms"], scenario["stages_ms"]["DenoisingStage"]) == (61.23, 70.0)
    assert overlay.with_name("h200.json.bak").read_bytes() == before
    # results of two machines sort themselves into two overlays; a forced --platform refuses the other machine's
    mixed = _perf_runs(tmp_path, "mi300x", [_measured(300.0, 30.0, 240.0, 30.0, [120.0, 120.0])]) + fast
    capsys.readouterr()
    assert main([*argv, "--results", *map(str, mixed)]) == 0
    assert (
        _read(baselines / "platforms" / "perf" / "mi300x.json")["scenarios"]["zimage_t2i_1rank"]["expected_e2e_ms"]
        == 300.0
    )
    assert main([*argv, "--results", *map(str, mixed), "--platform", "h200"]) == 2
    assert "results are from platform 'mi300x', not 'h200'" in capsys.readouterr().err


# ------------------------------------------------------------------------- killed mid-write


def _big_thresholds(path: Path, cases: int) -> dict[str, Any]:
    doc = json.loads(SGLANG_BASE.read_text())
    doc["cases"].update(
        {
            f"case_{i:05d}": {
                "clip_threshold": 0.9,
                "ssim_threshold": 0.9,
                "psnr_threshold": 20.0,
                "mean_abs_diff_threshold": 9.0,
            }
            for i in range(cases)
        }
    )
    path.write_text(json.dumps(doc, indent=4))
    return doc


def _kill_in_write(proc: subprocess.Popen, directory: Path, delay_s: float) -> None:
    """SIGKILL ``proc`` ``delay_s`` after its first temp file appears in ``directory``."""
    while proc.poll() is None and not any(name.endswith(".tmp") for name in os.listdir(directory)):
        time.sleep(0.0002)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.timeout(180)
def test_sigkill_at_random_points_leaves_old_or_new_never_partial(baselines: Path, tmp_path: Path) -> None:
    """A recalibration killed with SIGKILL leaves a baseline that parses and is either the old
    file or the new one. To be sure the write itself is hit (not the seconds of start-up before
    it), kills land at random moments after the writer's first temp file appears (the .bak
    copy, then the file). The writers run at once, each on its own copy, to pay start-up once."""
    base = baselines / "consistency_threshold.json"
    old = _big_thresholds(base, 10000)  # ~2 MB: a write that takes a while
    results = _results(tmp_path / "r.json", {"case_00001": _metrics(0.999, 0.99, 40.0, 1.0)})
    args = ["recalibrate", "thresholds", "--results", str(results), "--write"]
    assert main([*args, "--baselines", str(baselines)]) == 0  # in-process: the new file, for comparison
    new = json.loads(base.read_text())
    assert (
        new["cases"]["case_00001"]["psnr_threshold"] == 30.0
        and new["cases"]["case_00002"] == old["cases"]["case_00002"]
    )
    rng = random.Random(0)
    delays = [rng.uniform(0.0, 0.002), rng.uniform(0.002, 0.03)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = []
    for index, delay in enumerate(delays):
        directory = tmp_path / f"copy{index}"
        directory.mkdir()
        shutil.copy(base.with_name(base.name + ".bak"), directory / base.name)  # the old file
        proc = subprocess.Popen(
            [sys.executable, "-m", "harness.cli", *args, "--baselines", str(directory)],
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        killer = threading.Thread(target=_kill_in_write, args=(proc, directory, delay))
        killer.start()
        runs.append((directory, killer))
    for _, killer in runs:
        killer.join()
    targets = [directory / base.name for directory, _ in runs]
    docs = [json.loads(target.read_text()) for target in targets]  # never torn: it always parses ...
    assert [doc in (old, new) for doc in docs] == [True] * len(runs)  # ... and is exactly the old or the new document
    baks = [bak for t in targets if (bak := t.with_name(t.name + ".bak")).exists()]
    assert [json.loads(bak.read_text()) == old for bak in baks] == [True] * len(
        baks
    )  # the backup is complete too, or absent


def test_failed_runs_are_refused_unless_included_and_few_runs_warn(
    baselines: Path, three_runs: list[Path], capsys
) -> None:
    """The issue's case: one failed gate run proposed ssim 0.95 -> 0.2065 (LOOSENS) without a word."""
    failed = _read(three_runs[0])
    failed["passed"] = False
    failed["cases"]["flux_image_t2i"]["metrics"]["ssim"] = 0.2465
    failed["stages"] = {"images": {"records": [{"case_id": "flux_image_t2i", "status": "failed", "figures": {}}]}}
    three_runs[0].write_text(json.dumps(failed))
    argv = ["recalibrate", "thresholds", "--baselines", str(baselines), "--results"]
    assert main([*argv, str(three_runs[0])]) == 2
    err = capsys.readouterr().err
    assert "1 of 1 results come from a failed gate run" in err and f"{three_runs[0]} (failed: flux_image_t2i)" in err
    assert main([*argv, str(three_runs[0]), "--include-failed"]) == 0
    captured = capsys.readouterr()
    assert "using 1 failed run(s) (--include-failed)" in captured.err and "only 1 run(s)" in captured.err
    assert _rows(captured.out)[("flux_image_t2i", "ssim")] == ["0.95", "0.2465", "0.2065", "LOOSENS"]
    assert main([*argv, *map(str, three_runs[1:])]) == 0
    assert "only 2 run(s): proposals from fewer than 3" in capsys.readouterr().err
    assert main([*argv, *map(str, three_runs[1:]), str(three_runs[1])]) == 0
    assert "warning" not in capsys.readouterr().err


def test_perf_from_results_without_timings_says_how_to_get_them(
    baselines: Path, three_runs: list[Path], capsys
) -> None:
    assert main(["recalibrate", "perf", "--baselines", str(baselines), "--results", *map(str, three_runs)]) == 2
    err = capsys.readouterr().err
    assert "the results hold no timings (the perf stage did not run)" in err
    text = " ".join(err.split())
    assert (
        f"parity gate --perf --report perf-run1 --baselines {baselines} &&" in text
        and "platforms/perf/h200.json" in text
    )
