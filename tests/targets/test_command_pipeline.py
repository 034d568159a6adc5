"""The ``command`` pipeline target: template checks, safe argv, failures with stderr, timeouts, PNGs and timings read back.

The command is ``tests/targets/fake_generator.py`` (a seeded image from prompt and seed). These
tests run it in this process, as the gate does (no rank group); the gate end to end is in
``test_pipeline_gates.py``.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest

from harness.cases.image import ImageCase
from harness.errors import ConfigError, ParamError
from harness.perf import absolute
from harness.pipelines.sessions import Session
from harness.ranks import PoolSet
from harness.targets.base import PipelineFailed
from harness.targets.command_pipeline import CommandPipelineTarget, factory, read_pngs, read_timings
from harness.targets.loader import load_pipeline_target
from harness.targets.spec import TargetSpec
from tests.ranks.procs import wait_until_gone

GENERATOR = Path(__file__).with_name("fake_generator.py")
BASE = (
    f"{shlex.quote(sys.executable)} {shlex.quote(str(GENERATOR))} --prompt {{prompt}} --seed {{seed}} "
    "--height {height} --width {width} --out {out_dir} --world-size {world_size}"
)
FIELDS = {"prompt": "a lighthouse at dusk", "seed": 3, "height": 24, "width": 32}


def run_once(extra: str = "", fields: dict | None = None, world_size: int = 1, timeout: float = 60.0):  # noqa: ANN201
    target = CommandPipelineTarget(BASE + extra, timeout)
    fields = fields or FIELDS
    target.check_case(fields, world_size)
    prepared = target.prepare(fields, "cpu", world_size)
    try:
        return prepared.run()
    finally:
        prepared.close()


@pytest.fixture(autouse=True)
def _kept_outputs_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed command's output directory is kept for a human to read: in tests, inside tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.mark.parametrize(
    ("template", "fields", "key", "message"),
    [
        (None, FIELDS, "template", "no command"),
        ("gen --prompt {prompt}", FIELDS, "template", "must pass {out_dir}"),
        ("gen 'unclosed {out_dir}", FIELDS, "template", "cannot split"),
        (BASE, {**FIELDS, "steps": 4}, "steps", "not a placeholder of the template"),
        (BASE + " --cfg {guidance}", FIELDS, "template", "placeholder {guidance} has no value"),
        (BASE, {**FIELDS, "world_size": 2}, "world_size", "set by parity"),
        (BASE, {k: v for k, v in FIELDS.items() if k != "height"}, "height", "required: a positive int"),
        (BASE, {**FIELDS, "prompt": ["a", "b"]}, "prompt", "string, number or boolean"),
        (BASE.replace("{seed}", "{seed:04d}"), {**FIELDS, "seed": "x"}, "template", "cannot fill"),
        (BASE + " {0}", FIELDS, "template", "not a plain name"),
    ],
)
def test_case_mistakes_name_the_key(template: str | None, fields: dict, key: str, message: str) -> None:
    with pytest.raises(ParamError, match=message) as info:
        CommandPipelineTarget(template).check_case(fields, 1)
    assert info.value.key == key


def test_kind_template_from_a_case_field_and_factory_arguments() -> None:
    target = CommandPipelineTarget()  # no template argument: the case's own wins
    assert target.check_case({**FIELDS, "template": BASE}, 1) == "image"
    assert target.check_case({**FIELDS, "template": BASE + " --frames {num_frames}", "num_frames": 3}, 2) == "video"
    assert target.runs_in_ranks is False
    assert factory(BASE, "2.5").timeout == 2.5
    with pytest.raises(ConfigError, match="timeout must be a finite number"):
        factory(BASE, "soon")
    with pytest.raises(ConfigError, match="does not take"):
        load_pipeline_target(TargetSpec("command", (("templat", BASE),)))


def test_values_reach_the_command_as_single_arguments_never_as_shell(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    nasty = 'it\'s a "fox"; touch {marker} $(touch {marker}) `touch {marker}`'.format(marker=tmp_path / "pwned")
    out = run_once(f" --log {shlex.quote(str(log))}", {**FIELDS, "prompt": nasty}, world_size=4)
    argv = json.loads(log.read_text())["argv"]
    assert argv[argv.index("--prompt") + 1] == nasty and json.loads(log.read_text())["world_size"] == 4
    assert not (tmp_path / "pwned").exists()
    assert out.output.shape == (24, 32, 3) and out.output.dtype == np.uint8
    assert out.backends["timings"].startswith("none: e2e is the command's wall time")
    assert out.timings.stages_ms == {} and out.timings.e2e_ms > 0 and out.timings.clock == "command wall time"


def test_a_failing_command_fails_with_its_stderr_and_keeps_its_outputs() -> None:
    with pytest.raises(
        PipelineFailed, match=r"exited with status 3 \(RuntimeError: CUDA out of memory \(planted\)\)"
    ) as info:
        run_once(" --fail")
    assert "loading weights..." in info.value.detail and "--prompt 'a lighthouse at dusk'" in info.value.reason
    kept = Path(info.value.reason.rsplit("outputs kept in ", 1)[1].rstrip(")"))
    assert kept.is_dir()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def _timed_out(limit: int) -> Path:
    """The outputs a command sleeping 120 s left when ended by a ``limit`` s timeout."""
    with pytest.raises(PipelineFailed, match=f"timed out after {limit} s") as info:
        run_once(" --sleep 120", timeout=float(limit))
    return Path(info.value.reason.split("outputs kept in ", 1)[1].split(")", 1)[0])


def test_a_timeout_ends_the_command_and_everything_it_started() -> None:
    """The command starts a sleeping child first (its pid in the outputs). On a box loaded ~16 deep the command's
    Python took over 15 s to get there: then a longer limit is tried, so that there is a child to end."""
    kept = _timed_out(15)
    if not (kept / "sleeper.pid").exists():
        kept = _timed_out(90)
    sleeper = int((kept / "sleeper.pid").read_text())
    assert wait_until_gone([sleeper], 10) == []  # the command's own child, not only the command


def test_pngs_are_checked_against_the_case() -> None:
    wrong_size = BASE.replace("--height {height}", "--height 16")
    with pytest.raises(
        PipelineFailed, match=r"image.png: expected 8-bit RGB of shape \(24, 32, 3\), got uint8 \(16, 32, 3\)"
    ):
        _run_template(wrong_size, FIELDS)
    with pytest.raises(
        PipelineFailed, match=r"expected 3 PNGs in one directory under \{out_dir\}, found frames/0.png, frames/1.png"
    ):
        _run_template(BASE + " --frames 2", {**FIELDS, "num_frames": 3})


HUGE_PNG_HEADER = b"\x89PNG\r\n\x1a\n" + (13).to_bytes(4, "big") + b"IHDR" + (100_000).to_bytes(4, "big") * 2 + bytes(5)


@pytest.mark.parametrize(
    ("data", "words"),
    [(b"GIF89a not a png", "not a PNG file"), (HUGE_PNG_HEADER, "declares 100000x100000 pixels")],
    ids=["not-a-png", "huge"],
)
def test_a_commands_png_goes_through_the_guarded_decoder(tmp_path: Path, data: bytes, words: str) -> None:
    """Foreign output: a file that only claims to be a PNG, or declares a huge picture, is refused before decoding."""
    (tmp_path / "image.png").write_bytes(data)
    with pytest.raises(PipelineFailed, match=words):
        read_pngs(tmp_path, (24, 32, 3))


def _run_template(template: str, fields: dict) -> np.ndarray:
    target = CommandPipelineTarget(template)
    target.check_case(fields, 1)
    return target.prepare(fields, "cpu", 1).run().output


def test_frames_are_read_in_numeric_order(tmp_path: Path) -> None:
    frames = [np.full((4, 6, 3), i, np.uint8) for i in range(11)]
    (tmp_path / "video").mkdir()
    for i, frame in enumerate(frames):
        iio.imwrite(tmp_path / "video" / f"f{i}.png", frame)  # text order would put f10 before f2
    assert np.array_equal(read_pngs(tmp_path, (11, 4, 6, 3)), np.stack(frames))
    iio.imwrite(tmp_path / "video" / "f11.png", np.zeros((4, 6, 4), np.uint8))
    with pytest.raises(PipelineFailed, match="expected 11 PNGs"):
        read_pngs(tmp_path, (11, 4, 6, 3))


def test_timings_in_parity_and_sglang_schemas(tmp_path: Path) -> None:
    path = tmp_path / "timings.json"
    path.write_text(json.dumps({"e2e_ms": 9.5, "stages_ms": {"DenoisingStage": 6.0}, "denoise_step_ms": [3, 3.0]}))
    timings, source = read_timings(tmp_path, 1000.0)
    assert (timings.e2e_ms, timings.stages_ms, timings.denoise_step_ms, source) == (
        9.5,
        {"DenoisingStage": 6.0},
        [3.0, 3.0],
        "timings.json",
    )
    path.write_text(
        json.dumps(
            {
                "total_duration_ms": 14959.11,
                "steps": [{"name": "TextEncodingStage", "duration_ms": 611.83}],
                "denoise_steps_ms": [{"step": 0, "duration_ms": 240.5}],
                "commit_hash": "abc",
            }
        )
    )
    timings, source = read_timings(tmp_path, 1000.0)
    assert (timings.e2e_ms, timings.stages_ms, timings.denoise_step_ms) == (
        14959.11,
        {"TextEncodingStage": 611.83},
        [240.5],
    )
    assert source == "timings.json (sglang perf dump)"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["x"], "must be a JSON object"),
        ({"e2e_ms": -1}, "non-negative"),
        ({"steps": []}, "neither e2e_ms"),
        ({"total_duration_ms": 1, "steps": [{"name": "A"}]}, r"steps\[0\] must be an object with duration_ms"),
        ({"total_duration_ms": 1, "steps": [{"name": 7, "duration_ms": 1}]}, r"steps\[0\].name must be a stage's name"),
        ({"total_duration_ms": 1, "steps": [{"name": "", "duration_ms": 1}]}, r"steps\[0\].name must be"),
        ({"total_duration_ms": 1, "steps": [{"duration_ms": 1}]}, r"steps\[0\].name must be"),
        (
            {"total_duration_ms": 1, "steps": [{"name": "A", "duration_ms": 1}, {"name": "A", "duration_ms": 2}]},
            "names a stage twice",
        ),
        ({"total_duration_ms": 1, "steps": {"A": 1}}, "steps must be a list"),
        ({"total_duration_ms": 1, "denoise_steps_ms": [3]}, r"denoise_steps_ms\[0\] must be an object"),
    ],
    ids=[
        "not-an-object",
        "negative",
        "no-total",
        "step-without-duration",
        "step-name-a-number",
        "step-name-empty",
        "step-without-name",
        "stage-twice",
        "steps-not-a-list",
        "denoise-step-not-an-object",
    ],
)
def test_timings_of_another_shape_are_refused(tmp_path: Path, bad: object, message: str) -> None:
    (tmp_path / "timings.json").write_text(json.dumps(bad))
    with pytest.raises(PipelineFailed, match=message):
        read_timings(tmp_path, 1.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "line 1"),
        ('{"e2e_ms": NaN}', "NaN"),
        ('{"e2e_ms": 1, "stages_ms": {"A": Infinity}}', "Infinity"),
    ],
    ids=["malformed", "nan", "infinity"],
)
def test_timings_that_are_not_strict_json_are_refused_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "timings.json"
    path.write_text(text)
    with pytest.raises(PipelineFailed, match=message) as info:
        read_timings(tmp_path, 1.0)
    assert str(path) in str(info.value)  # the file is named


def test_perf_timing_runs_here_with_the_commands_own_timings() -> None:
    fields = {**FIELDS, "template": BASE + " --timings {timings}"}
    case = ImageCase(
        "cmd",
        kind="image",
        world_size=2,
        ulysses_degree=2,
        ring_degree=1,
        fields=fields,
        target=TargetSpec("command"),
        source="<test>",
    )
    with PoolSet("cpu") as pools, Session(case.pipeline_run, pools) as session:
        measured = absolute.measure(session, runs=2, warmup=1)
        assert pools.startup_s == {}  # no rank group was started: the command does its own parallelism
    # the command's own figures, as it reported them (raw), and parity's clock of the process apart
    assert measured["stages_ms"] == {"TextEncodingStage": 1.0, "DenoisingStage": 1.5, "DecodingStage": 0.5}
    assert measured["denoise_step_ms"] == {"0": 0.75, "1": 0.75}
    assert len(measured["samples"]["wall_ms"]) == 2 and measured["clock"] == "command timings.json"
    samples = measured["samples"]
    # run by run (across runs a loaded box moves both by seconds): the process's start counts in parity's clock
    assert all(wall > e2e for wall, e2e in zip(samples["wall_ms"], samples["expected_e2e_ms"], strict=True))
    assert measured["peak_memory_mb"] is None and measured["peak_memory_kind"] == "not_measured"
