"""The project file: found like pytest's rootdir, validated naming file and key, read by every verb,
overridden by the command line; ``parity init``; writes that stay in the project; hints that carry
what the bare command would not find by itself."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from harness.baselines.perf import PerfBaselines
from harness.baselines.thresholds import ThresholdSet
from harness.cli import main
from harness.errors import ConfigError
from harness.paths import default_baselines_dir, default_cases_dir, parity_home
from harness.project import Project, carried_options, find_project, load_project
from harness.targets.spec import TargetSpec

GENERATOR = Path(__file__).resolve().parents[1] / "targets" / "fake_generator.py"


def _digest(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_nearest_project_file_upwards_governs_and_a_pyproject_without_the_table_is_passed_over(
    tmp_path: Path,
) -> None:
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (tmp_path / "a" / "parity.toml").write_text("")
    (tmp_path / "a" / "b" / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.black]\nline-length = 1\n')
    assert find_project(deep) == tmp_path / "a" / "parity.toml"
    (tmp_path / "a" / "b" / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.parity]\ndevice = "cpu"\n')
    assert find_project(deep) == tmp_path / "a" / "b" / "pyproject.toml"
    assert load_project(tmp_path / "a" / "b" / "pyproject.toml").device == "cpu"
    (tmp_path / "a" / "b" / "parity.toml").write_text("")
    with pytest.raises(ConfigError, match=r"b: both parity.toml and \[tool.parity\]"):
        find_project(deep)


@pytest.mark.parametrize(
    ("body", "key", "message"),
    [
        ('cases_dir = "x"', "cases_dir", "unknown key"),
        ('cases = "missing"', "cases", "no such directory"),
        ("cases = 3", "cases", "must be a non-empty string"),
        ('device = "tpu"', "device", "must be one of cpu, cuda"),
        ('profile = "fast"', "profile", "must be one of pr_test, long_term"),
        ("target_args = { n = 3 }", "target_args.n", "must be a string"),
        ('target_args = { "not-a-name" = "x" }', "target_args", "KEY a Python identifier"),
        ('pipeline_target_args = "template=x"', "pipeline_target_args", "must be a table"),
        ('cases = "/etc"', "cases", "/etc holds no contracts/, images/ or perf/ folder of cases"),
        ('baselines = "/dev"', "baselines", "/dev holds no consistency_threshold.json"),
    ],
    ids=[
        "unknown",
        "missing-dir",
        "not-a-string",
        "device",
        "profile",
        "arg-type",
        "arg-name",
        "args-not-a-table",
        "cases-not-cases",
        "baselines-not-baselines",
    ],
)
@pytest.mark.parametrize("where", ["parity.toml", "pyproject.toml"])
def test_a_bad_project_file_names_its_file_and_key(
    tmp_path: Path, where: str, body: str, key: str, message: str
) -> None:
    text = body if where == "parity.toml" else f"[tool.parity]\n{body}\n"
    (tmp_path / where).write_text(text)
    full = key if where == "parity.toml" else f"tool.parity.{key}"
    with pytest.raises(ConfigError, match=message) as caught:
        load_project(tmp_path / where)
    assert caught.value.path == str(tmp_path / where) and caught.value.key == full


def test_a_bad_project_file_exits_2_for_every_verb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "parity.toml").write_text('device = "tpu"\n')
    monkeypatch.chdir(tmp_path)
    assert main(["doctor"]) == 2
    assert f"{tmp_path / 'parity.toml'}: key 'device': must be one of cpu, cuda" in capsys.readouterr().err


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Path:
    """A project made by ``parity init``, the working directory of the test."""
    root = tmp_path / "proj"
    assert main(["init", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-4:] == [
        "  " + shlex.join(["cd", str(root)]),
        "  parity check",
        "  parity bless --all",
        "  parity gate --report parity-report",
    ]
    monkeypatch.chdir(root)
    return root


def test_init_writes_a_project_whose_baselines_load_and_refuses_to_overwrite(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baselines = project / "parity" / "baselines"
    assert ThresholdSet.load(baselines / "consistency_threshold.json").for_case("anything", "image").get("psnr") == 30.0
    assert PerfBaselines.load(baselines / "perf_baselines.json").scenario_ids == []
    before = _digest(project)
    assert main(["init"]) == 2
    assert "already exist(s), nothing was written" in capsys.readouterr().err and _digest(project) == before


def test_init_refuses_a_directory_inside_parity(capsys: pytest.CaptureFixture[str]) -> None:
    inside = parity_home() / "some-project"
    assert main(["init", str(inside)]) == 2
    assert "inside parity itself" in capsys.readouterr().err and not inside.exists()


def _plant_init_dir(tmp_path: Path, kind: str) -> Path:
    """A DIR for ``parity init`` that cannot hold a project (issue 39, leftovers 1 and 2)."""
    if kind == "file":
        (tmp_path / "f").write_text("x")
        return tmp_path / "f"
    if kind == "fifo":
        os.mkfifo(tmp_path / "p")
        return tmp_path / "p"
    if kind == "parity_is_a_file":
        (tmp_path / "new").mkdir()
        (tmp_path / "new" / "parity").write_text("x")
        return tmp_path / "new"
    if kind == "too_long":
        return tmp_path / ("x" * 4096)
    return Path({"dev_null": "/dev/null", "proc": "/proc/self/parity-project"}[kind])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FIFOs, /proc")
@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("file", "exists and is not a folder"),
        ("fifo", "exists and is not a folder"),
        ("dev_null", "exists and is not a folder"),
        ("proc", "cannot be written"),
        ("too_long", "cannot be used: File name too long"),
        ("parity_is_a_file", "exists and is not a folder"),
    ],
)
def test_init_into_what_cannot_hold_a_project_is_refused_writing_nothing(
    tmp_path: Path, kind: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _plant_init_dir(tmp_path, kind)
    before = sorted(tmp_path.rglob("*"))
    assert main(["init", str(target)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and err.count("\n") == 1, err
    assert sorted(tmp_path.rglob("*")) == before  # parity.toml included: nothing written


def test_every_verb_reads_the_project_and_the_command_line_overrides_it(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["list", "--json", "-"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in listed["image_cases"]] == ["example_1rank", "example_2ranks"]
    assert [c["id"] for c in listed["cases"]] == ["example_ulysses"]
    assert main(["list", "--json", "-", "--cases", str(default_cases_dir())]) == 0
    assert "zimage_t2i_1rank" in [c["id"] for c in json.loads(capsys.readouterr().out)["image_cases"]]
    assert main(["doctor", "--json", "-"]) == 0
    doctor = json.loads(capsys.readouterr().out)
    assert doctor["project"]["file"] == str(project / "parity.toml")
    assert doctor["paths"]["baselines"] == str(project / "parity" / "baselines")
    assert main(["doctor"]) == 0
    assert f"project file {project / 'parity.toml'}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "verb",
    [
        ["bless", "--all"],
        ["recalibrate", "perf", "--results", "nothing.json", "--write"],
        ["recalibrate", "thresholds", "--results", "nothing.json", "--write"],
    ],
    ids=["bless", "recalibrate-perf", "recalibrate-thresholds"],
)
def test_with_a_project_in_use_parity_own_baselines_are_never_written(
    project: Path, verb: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    before = _digest(default_baselines_dir())
    assert main([*verb, "--baselines", str(default_baselines_dir())]) == 2
    err = capsys.readouterr().err
    assert f"the project file {project / 'parity.toml'} is in use, so writes go to its baselines" in err
    assert _digest(default_baselines_dir()) == before


def test_an_image_only_project_gates_and_its_hint_blesses_verbatim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No contract case; the pipeline from the project file; the bless hint carries nothing the file already says."""
    root = tmp_path / "imgs"
    assert main(["init", str(root), "--images-only"]) == 0
    assert "parity check" not in capsys.readouterr().out and not (root / "parity" / "cases" / "contracts").exists()
    (root / "parity" / "cases" / "images" / "example.toml").write_text(
        '[defaults]\nunmeasured = { clip = "no CLIP model configured" }\nprompt = "a lighthouse"\nseed = 3\nheight = 16\nwidth = 16\n\n[cases.gen_1rank]\n'
    )
    template = (
        f"{shlex.quote(sys.executable)} {shlex.quote(str(GENERATOR))} --prompt {{prompt}} --seed {{seed}} "
        f"--height {{height}} --width {{width}} --out {{out_dir}}"
    )
    with (root / "parity.toml").open("a") as fh:
        fh.write(f'pipeline_target = "command"\npipeline_target_args = {{ template = {json.dumps(template)} }}\n')
    monkeypatch.chdir(root)
    assert main(["gate", "--json", "out.json"]) == 1
    doc = json.loads((root / "out.json").read_text())
    assert doc["stages"]["contracts"] == {
        "skipped": f"no contract cases ({root / 'parity' / 'cases' / 'contracts'} does not exist)"
    }
    assert doc["project"] == str(root / "parity.toml")
    (record,) = doc["stages"]["images"]["records"]
    assert record["next_step"] == "parity bless gen_1rank"
    assert main(shlex.split(record["next_step"])[1:]) == 0
    assert main(["gate"]) == 0
    assert (root / "parity" / "baselines" / "images" / "gen_1rank.png").is_file()


def _project(tmp_path: Path, **keys: object) -> Project:
    (tmp_path / "c").mkdir(exist_ok=True)
    return Project(tmp_path / "parity.toml", "", cases=tmp_path / "c", **keys)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("keys", "given", "carried"),
    [
        ({}, {"pipeline": TargetSpec("reference", ())}, []),
        (
            {},
            {"pipeline": TargetSpec("command", (("template", "g {out_dir}"),))},
            ["--pipeline-target", "command", "--pipeline-target-arg", "template=g {out_dir}"],
        ),
        (
            {"pipeline_target": "command", "pipeline_target_args": (("template", "g {out_dir}"),)},
            {"pipeline": TargetSpec("command", (("template", "g {out_dir}"),))},
            [],
        ),
        ({"pipeline_target": "command"}, {"pipeline": TargetSpec("reference", ())}, ["--pipeline-target", "reference"]),
        ({"device": "cuda"}, {"device": "cuda"}, []),
        ({"device": "cuda"}, {"device": "cpu"}, ["--device", "cpu"]),
        ({}, {"target": TargetSpec("mod:f", (("n", "1"),))}, ["--target", "mod:f", "--target-arg", "n=1"]),
    ],
    ids=[
        "default",
        "cli-pipeline",
        "project-pipeline",
        "back-to-default",
        "project-device",
        "cli-device",
        "cli-target",
    ],
)
def test_a_hint_carries_what_the_bare_command_would_not_find(
    tmp_path: Path, keys: dict, given: dict, carried: list[str]
) -> None:
    assert carried_options(_project(tmp_path, **keys), **given) == carried


def test_a_hint_carries_cases_and_baselines_unless_the_project_names_them(tmp_path: Path) -> None:
    p = _project(tmp_path)
    assert carried_options(p, cases=tmp_path / "c", baselines=default_baselines_dir()) == []
    assert carried_options(p, cases=default_cases_dir()) == ["--cases", str(default_cases_dir())]
    assert carried_options(None, cases=default_cases_dir(), baselines=tmp_path) == ["--baselines", str(tmp_path)]
