"""Image case files: the documented format loads; every mistake is a ConfigError naming file, case and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cases.image import ImageCase, select_image_cases
from harness.cases.image import load_image_cases as load_with
from harness.errors import ConfigError
from harness.paths import default_cases_dir
from harness.targets.reference.pipeline import PipelineConfig, pipeline_config
from harness.targets.spec import TargetSpec


def load_image_cases(root: Path) -> list[ImageCase]:
    return load_with(root)


def config(case: ImageCase) -> PipelineConfig:
    return pipeline_config(case.fields)


def _write(root: Path, text: str, name: str = "cases.toml") -> Path:
    (root / "images").mkdir(parents=True, exist_ok=True)
    path = root / "images" / name
    path.write_text(text)
    return path


def test_the_projects_cases_load() -> None:
    cases = {c.id: c for c in load_image_cases(default_cases_dir())}
    assert {"zimage_t2i_1rank", "zimage_t2i_2ranks", "hunyuan_t2v_2ranks"} <= set(cases)
    one, two, video = cases["zimage_t2i_1rank"], cases["zimage_t2i_2ranks"], cases["hunyuan_t2v_2ranks"]
    assert (one.world_size, two.world_size, two.ulysses_degree, two.ring_degree) == (1, 2, 2, 1)
    assert config(one) == config(two)  # the SP=2 case must reproduce the 1-rank image of the same request
    assert video.kind == "video" and config(video).num_frames and one.kind == "image"
    assert two.reference_case().world_size == 1 and config(two.reference_case()) == config(two)


def test_defaults_apply_and_the_case_wins(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "[defaults]\nsteps = 3\nheight = 16\n[cases.a]\nwidth = 16\n[cases.b]\nworld_size = 2\nwidth = 32\nsteps = 5\n",
    )
    a, b = load_image_cases(tmp_path)
    assert (config(a).steps, config(a).height, a.world_size, a.ulysses_degree) == (3, 16, 1, 1)
    assert (config(b).steps, config(b).width, b.ulysses_degree) == (5, 32, 2)
    assert [c.id for c in select_image_cases([a, b], ["b"])] == ["b"]
    with pytest.raises(ConfigError, match="no image case 'c'; known: a, b"):
        select_image_cases([a, b], ["c"])


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        ("[cases.a]\nstep = 3\n", "cases.a.step", "unknown key"),
        ("[cases.a]\nsteps = 'x'\n", "cases.a.steps", "expected an int"),
        ("[cases.a]\nheight = 20\n", "cases.a.height", "multiple of 8"),
        ("[cases.a]\nworld_size = 0\n", "cases.a.world_size", "positive integer"),
        ("[cases.a]\nworld_size = 2\nulysses_degree = 1\n", "cases.a.ulysses_degree", "must equal world_size"),
        ("[cases.a]\nworld_size = 2\nring_degree = 2\nulysses_degree = 1\n", "cases.a.ring_degree", "Ulysses only"),
        ("[cases.a]\nworld_size = 3\n", "cases.a.world_size", "do not divide by world_size 3"),
        ("[cases.a]\nkind = 'video'\n", "cases.a.kind", "makes it 'image'"),
        ("[cases.a]\ndevice = 'cuda'\n", "cases.a.device", "set by the runner"),
        ("[defaults]\nworld_size = 2\n[cases.a]\n", "defaults.world_size", "set it per case"),
        ("[defaults]\nsteps = -1\n[cases.a]\n", "cases.a.steps", r"from \[defaults\]"),
        ('[cases."../x"]\n', "cases.../x", "file name"),
        ("[case.a]\n", "case", "unknown top-level table"),
        ("[defaults]\n", "cases", "no cases"),
        # a pipeline target mistake names the key that chose the target
        ("[cases.a]\ntarget = 3\n", "cases.a.target", "must be a pipeline target name"),
        (
            "[cases.a]\ntarget = 'nope'\n",
            "cases.a.target",
            "unknown pipeline target 'nope'; built-in pipeline targets: reference, diffusers, command",
        ),
        (
            "[defaults]\ntarget = 'no_such_module:factory'\n[cases.a]\n",
            "defaults.target",
            "cannot import module 'no_such_module'",
        ),
        ("[cases.a]\ntarget = 'command'\nheight = 8\nwidth = 8\n", "cases.a.template", "no command"),
        ("[cases.a]\nunmeasured = 'clip'\n", "cases.a.unmeasured", "a table of metric"),
        ("[defaults]\nunmeasured = { lpips = 'x' }\n[cases.a]\n", "defaults.unmeasured.lpips", "not a metric"),
        ("[cases.a]\nunmeasured = { clip = '' }\n", "cases.a.unmeasured.clip", "non-empty string"),
    ],
)
def test_mistakes_name_file_case_and_key(tmp_path: Path, text: str, key: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_image_cases(tmp_path)
    assert info.value.path == str(path) and info.value.key == key


def test_bad_toml_duplicates_and_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such image case directory"):
        load_image_cases(tmp_path)
    _write(tmp_path, "[cases.a]\n", "one.toml")
    second = _write(tmp_path, "[cases.a]\n", "two.toml")
    with pytest.raises(ConfigError, match="also defined in") as info:
        load_image_cases(tmp_path)
    assert info.value.path == str(second)
    second.write_text("[cases.a\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_image_cases(tmp_path)


def test_each_case_names_its_pipeline_target_and_only_the_default_gets_its_arguments(tmp_path: Path) -> None:
    _write(tmp_path, "[defaults]\nheight = 16\nwidth = 16\n[cases.ref]\ntarget = 'reference'\nsteps = 2\n[cases.cmd]\n")
    _write(tmp_path, "[defaults]\ntarget = 'reference'\n[cases.file_default]\n", "other.toml")
    template = (("template", "true --seed 1 {out_dir}"),)
    ref, cmd, file_default = load_with(tmp_path, TargetSpec("command", template))
    assert (ref.target, ref.kind) == (TargetSpec("reference"), "image")
    assert (cmd.target, cmd.kind) == (TargetSpec("command", template), "image")
    assert file_default.target == TargetSpec("reference")
    assert "target" not in ref.fields and "target" not in file_default.fields


def test_an_unknown_default_pipeline_target_is_the_options_error(tmp_path: Path) -> None:
    _write(tmp_path, "[cases.a]\n")
    with pytest.raises(ConfigError, match="unknown pipeline target 'nope'") as info:
        load_with(tmp_path, TargetSpec("nope"))
    assert info.value.path is None and info.value.key == "--pipeline-target"
