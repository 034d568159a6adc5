"""``parity bless`` and the gate's image stage end to end: real pipeline runs on real rank groups, real files.

A tiny project in a temp dir (one cheap contract case, a 1-rank image case and a 2-rank video
case of 16×16 pixels) keeps each gate run to seconds; the project's own thresholds file is used.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest

from harness.baselines.image_writes import bless
from harness.baselines.images import load_reference, read_manifest
from harness.cli import main
from harness.report.triptych import heatmap, triptych
from harness.results import load_results
from tests.gate_project import clip_pinned, gate_project
from tests.images.tiny_clip import save_tiny_clip

pytestmark = pytest.mark.timeout(300)

IMAGE_CASES = """\
[defaults]
prompt = "a lighthouse at dusk"
height = 16
width = 16
steps = 2

[cases.img_1rank]
world_size = 1

[cases.vid_2ranks]
world_size = 2
num_frames = 3
"""


@dataclass(frozen=True)
class Project:
    cases: Path
    baselines: Path

    def copy_baselines(self, tmp_path: Path) -> Path:
        copy = tmp_path / "baselines_copy"
        shutil.copytree(self.baselines, copy)
        return copy


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Project:
    cases, baselines = gate_project(tmp_path_factory.mktemp("project"), tiny=IMAGE_CASES)
    assert main(["bless", "--all", "--cases", str(cases), "--baselines", str(baselines)]) == 0
    return Project(cases, baselines)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


def _gate(project: Project, *extra: str, baselines: Path | None = None) -> int:
    return main(["gate", "--cases", str(project.cases), "--baselines", str(baselines or project.baselines), *extra])


def test_bless_writes_hashed_references_only_when_asked(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    entries = read_manifest(project.baselines / "images")
    assert list(entries["img_1rank"].files) == ["img_1rank.png"]
    assert list(entries["vid_2ranks"].files) == [f"vid_2ranks/frame_{i:04d}.png" for i in range(3)]
    assert {
        case_id: (e.fields and e.fields["prompt"], e.world_size) for case_id, e in entries.items()
    } == dict.fromkeys(entries, ("a lighthouse at dusk", 1))
    digests = {name: digest for e in entries.values() for name, digest in e.files.items()}
    assert {
        name: hashlib.sha256((project.baselines / "images" / name).read_bytes()).hexdigest() for name in digests
    } == digests
    assert load_reference(project.baselines / "images", "img_1rank").shape == (16, 16, 3)
    assert load_reference(project.baselines / "images", "vid_2ranks").shape == (3, 16, 16, 3)
    assert main(["bless", "nope", "--cases", str(project.cases), "--baselines", str(project.baselines)]) == 2
    assert "no image case 'nope'; known: img_1rank, vid_2ranks" in capsys.readouterr().err


def test_gate_passes_with_a_clip_figure_and_leaves_references_alone(
    project: Project, clip_dir: Path, tmp_path: Path
) -> None:
    manifest = project.baselines / "images" / "manifest.json"
    before = manifest.read_bytes()
    out = tmp_path / "results.json"
    assert _gate(project, "--clip-model", str(clip_dir), "--json", str(out)) == 0
    assert manifest.read_bytes() == before
    doc = load_results(out)  # the schema recalibration reads
    cases = ("img_1rank", "vid_2ranks")  # SP=2 and one rank reproduce the single-rank reference bitwise
    got = {
        c: (doc["cases"][c]["passed"], *(doc["cases"][c]["metrics"][m] for m in ("psnr", "ssim", "mean_abs_diff")))
        for c in cases
    }
    assert got == dict.fromkeys(cases, (True, float("inf"), 1.0, 0.0))
    assert {c: doc["cases"][c]["metrics"]["clip"] for c in cases} == pytest.approx(dict.fromkeys(cases, 1.0), abs=1e-6)
    assert doc["cases"]["vid_2ranks"]["kind"] == "video" and doc["platform"] == doc["stages"]["images"]["platform"]
    record = {r["case_id"]: r for r in doc["stages"]["images"]["records"]}["img_1rank"]
    assert record["figures"]["threshold_source"]["psnr"].endswith(
        "consistency_threshold.json:default_psnr_threshold_image"
    )
    assert record["figures"]["thresholds"]["psnr"] == 30.0 and doc["stages"]["images"]["clip_skipped"] is None


def test_unreachable_threshold_fails_with_triptych_report_and_clip_skipped(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PARITY_CLIP_MODEL", raising=False)
    copy = project.copy_baselines(tmp_path)
    # A reference one level off in a few pixels of the middle frame (blessed through the one writer):
    # well inside the project's bounds, but not identical, so psnr is finite and 200 dB unreachable.
    video = load_reference(copy / "images", "vid_2ranks").copy()
    corner = video[1, :4, :4]
    video[1, :4, :4] = np.where(corner < 255, corner + 1, corner - 1)
    bless(copy / "images", "vid_2ranks", video, read_manifest(copy / "images")["vid_2ranks"].fields)
    thresholds = json.loads((copy / "consistency_threshold.json").read_text())
    thresholds["cases"]["vid_2ranks"] = {"psnr_threshold": 200}
    (copy / "consistency_threshold.json").write_text(json.dumps(thresholds))
    report = tmp_path / "report"
    assert _gate(project, "--report", str(report), baselines=copy) == 1

    doc = load_results(report / "results.json")
    assert doc["passed"] is False and doc["cases"]["img_1rank"]["passed"] is True
    failed = doc["cases"]["vid_2ranks"]
    assert failed["passed"] is False and 60 < failed["metrics"]["psnr"] < 200
    assert all(case["metrics"]["clip"] is None for case in doc["cases"].values())
    assert "PARITY_CLIP_MODEL" in failed["skipped_metrics"]["clip"]
    record = {r["case_id"]: r for r in doc["stages"]["images"]["records"]}["vid_2ranks"]
    assert (
        "psnr" in record["reason"]
        and "< 200" in record["reason"]
        and "cases.vid_2ranks.psnr_threshold" in record["reason"]
    )

    candidate = load_reference(report / "candidates", "vid_2ranks")  # the failing case's output, saved as a set
    assert np.array_equal(candidate, load_reference(project.baselines / "images", "vid_2ranks"))  # SP=2 reproduced it
    drawn = triptych(video, candidate)
    assert np.array_equal(iio.imread(report / record["artifacts"]["triptych"]), drawn.picture)
    assert len(drawn.panels) == 3  # every frame, one row each
    (y, x, h, w), _, (dy, dx, _, _) = drawn.panels[1]
    k = drawn.scale
    assert np.array_equal(
        drawn.picture[y : y + h : k, x : x + w : k], video[1]
    )  # the reference panel holds the blessed frame
    one_level = heatmap(np.ones((1, 1)))[0, 0]
    assert (
        one_level.tolist() == [96, 0, 0]
        and (drawn.picture[dy : dy + 4 * k : k, dx : dx + 4 * k : k] == one_level).all()
    )
    frames = record["figures"]["frames"]
    assert [(f["frame"], f["psnr"], f["max_abs_diff"]) for f in frames][0::2] == [(0, "inf", 0), (2, "inf", 0)]
    assert frames[1]["max_abs_diff"] == 1 and frames[1]["mean_abs_diff"] == pytest.approx(16 / 256)
    page = (report / "index.html").read_text()
    assert f"<img src='{record['artifacts']['triptych']}'" in page and "precedence" in page
    assert (
        page.index("id='failures'") < page.index("id='images-vid_2ranks'") < page.index("<details><summary>contracts")
    )
    junit = (report / "junit.xml").read_text()
    assert 'name="vid_2ranks"' in junit and "<failure" in junit


def test_malformed_thresholds_exit_2_naming_file_and_key_before_any_case_runs(
    project: Project, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = project.copy_baselines(tmp_path)
    path = copy / "consistency_threshold.json"
    thresholds = json.loads(path.read_text())
    thresholds["cases"]["img_1rank"] = {"ssim_threshold": "high"}
    path.write_text(json.dumps(thresholds))
    assert _gate(project, baselines=copy) == 2
    captured = capsys.readouterr()
    assert str(path) in captured.err and "cases.img_1rank.ssim_threshold" in captured.err
    assert "contracts:" not in captured.out  # the image stage's preflight stopped the gate first


def test_tampered_reference_exits_2_naming_the_file(
    project: Project, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = project.copy_baselines(tmp_path)
    image = copy / "images" / "img_1rank.png"
    iio.imwrite(image, np.zeros((16, 16, 3), np.uint8))  # a valid PNG the manifest never saw
    assert _gate(project, baselines=copy) == 2
    err = capsys.readouterr().err
    assert str(image) in err and "sha256 mismatch" in err
    # blessing is how a reference that fails its check is repaired (say after a merge took the other side's manifest)
    assert main(["bless", "img_1rank", "--json", "-", "--cases", str(project.cases), "--baselines", str(copy)]) == 0
    (change,) = json.loads(capsys.readouterr().out)["changes"]
    assert change["change"] == "repaired" and any("sha256 mismatch" in f for f in change["fields_changed"])
    assert _gate(project, baselines=copy) == 0
    # a manifest that cannot be read is not a reference to repair: bless stops, naming it, even in a dry run
    manifest = copy / "images" / "manifest.json"
    manifest.write_text('{"format": 3}')
    capsys.readouterr()
    assert main(["bless", "img_1rank", "--dry-run", "--cases", str(project.cases), "--baselines", str(copy)]) == 2
    err = capsys.readouterr().err
    assert str(manifest) in err and "repaired" not in err


def test_bless_names_cases_and_dry_run_writes_nothing(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    where = ["--cases", str(project.cases), "--baselines", str(project.baselines)]
    manifest = project.baselines / "images" / "manifest.json"
    before = manifest.read_bytes()
    assert main(["bless", *where]) == 2  # never every case by default
    assert "name the image cases to bless, or pass --all" in capsys.readouterr().err
    assert main(["bless", "img_1rank", "--dry-run", "--json", "-", *where]) == 0
    captured = capsys.readouterr()
    (change,) = json.loads(captured.out)["changes"]
    assert change["case_id"] == "img_1rank" and change["change"] == "unchanged" and change["psnr_old_vs_new"] == "inf"
    assert change["old_sha256"] == change["new_sha256"] and "dry run: nothing written" in captured.err
    assert manifest.read_bytes() == before


def test_an_unmeasured_bound_fails_unless_the_case_pins_it(
    project: Project, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No CLIP model: the clip bound is a skip of that metric; unpinned it fails, pinned it is counted, never a pass."""
    cases = tmp_path / "cases"
    shutil.copytree(project.cases, cases)
    (cases / "images" / "tiny.toml").write_text(IMAGE_CASES)  # no `unmeasured`
    assert main(["gate", "--no-perf", "--cases", str(cases), "--baselines", str(project.baselines)]) == 1
    out = capsys.readouterr().out
    assert "clip bound not measured (no CLIP model configured" in out and "does not pin it" in out
    assert main(["gate", "--no-perf", "--cases", str(project.cases), "--baselines", str(project.baselines)]) == 0
    out = capsys.readouterr().out
    assert "images: 2 passed, 0 failed, 0 skipped in" in out and "; clip not measured in 2 cases (no CLIP model" in out
    assert "│ skipped │" in out  # the clip column says so, not "-"


def test_changed_and_new_cases_ask_for_a_bless_and_from_results_promotes_the_gate_run(
    project: Project, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The --force-regen workflow: the gate fails naming the bless, bless promotes what that run made, the gate passes."""
    cases = tmp_path / "cases"
    shutil.copytree(project.cases, cases)
    text = IMAGE_CASES.replace("[cases.img_1rank]\nworld_size = 1\n", "[cases.img_1rank]\nworld_size = 1\nseed = 5\n")
    (cases / "images" / "tiny.toml").write_text(clip_pinned(text + "\n[cases.img_new]\nseed = 7\n"))
    copy = project.copy_baselines(tmp_path)
    where = ["--cases", str(cases), "--baselines", str(copy)]
    report = tmp_path / "report"
    (report / "candidates").mkdir(parents=True)
    (report / "candidates" / "from_an_older_run.png").write_bytes(b"old")
    assert main(["gate", *where, "--report", str(report), "--keep-outputs"]) == 1
    assert not (report / "candidates" / "from_an_older_run.png").exists()  # only this run's candidates
    out = capsys.readouterr().out
    records = {r["case_id"]: r for r in load_results(report / "results.json")["stages"]["images"]["records"]}
    stale, new = records["img_1rank"], records["img_new"]
    carried = f"--cases {cases} --baselines {copy}"  # the hints repeat the options this gate ran with
    assert (
        stale["reason"] == f"case changed since it was blessed (seed 5 added): run `parity bless img_1rank {carried}`"
    )
    assert new["reason"] == f"no reference yet: run `parity bless img_new {carried}`"
    assert new["next_step"] == f"parity bless img_new {carried}"
    assert stale["figures"]["reference"] == "changed" and stale["figures"]["psnr"] is None  # not judged on pixels
    old_vs_new = triptych(
        load_reference(copy / "images", "img_1rank"), load_reference(report / "candidates", "img_1rank")
    )
    assert np.array_equal(
        iio.imread(report / stale["artifacts"]["triptych"]), old_vs_new.picture
    )  # still shown side by side
    assert records["vid_2ranks"]["status"] == "passed" and records["vid_2ranks"]["artifacts"]["candidate"]
    lines = out.strip().splitlines()
    assert lines[-1] == "gate: FAILED (2 failing cases: img_1rank, img_new)"
    assert f"    -> parity bless img_1rank {carried}" in lines and f"report: {report / 'index.html'}" in lines

    assert main(["bless", "--from-results", str(report), *where]) == 2
    assert f"parity bless --from-results {report} img_1rank img_new {carried}" in capsys.readouterr().err
    assert main(["bless", "--from-results", str(report), "vid_2ranks", *where]) == 2  # an SP=2 output is no reference
    assert "ran on 2 ranks and a reference is a one-rank output" in capsys.readouterr().err
    manifest = (copy / "images" / "manifest.json").read_bytes()
    assert (
        main(["bless", "--from-results", str(report), "img_1rank", "img_new", "--dry-run", "--json", "-", *where]) == 0
    )
    changes = {c["case_id"]: c for c in json.loads(capsys.readouterr().out)["changes"]}
    assert changes["img_1rank"]["change"] == "changed" and changes["img_1rank"]["fields_changed"] == ["seed 5 added"]
    assert 0 < changes["img_1rank"]["psnr_old_vs_new"] < 60 and changes["img_new"]["change"] == "new"
    assert (copy / "images" / "manifest.json").read_bytes() == manifest  # a dry run writes nothing
    assert main(["bless", "--from-results", str(report), "img_1rank", "img_new", *where]) == 0
    capsys.readouterr()
    entries = read_manifest(copy / "images")
    promoted = load_reference(report / "candidates", "img_1rank")
    assert entries["img_1rank"].fields["seed"] == 5 and np.array_equal(
        load_reference(copy / "images", "img_1rank"), promoted
    )
    assert _gate(Project(cases, copy)) == 0
