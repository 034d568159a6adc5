"""The ``diffusers`` pipeline target on a tiny FluxPipeline saved to a temp dir and loaded the real way.

Field checks in this process; generation and timing in real 1-rank groups; the one fact behind
the CPU refusal of W > 1 measured, so a diffusers release that fixes it is noticed. The gate end
to end is in ``test_pipeline_gates.py``; W = 2 under diffusers' context parallelism in
``tests/gpu/test_diffusers_pipeline_cp.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.cases.image import ImageCase
from harness.errors import ParamError
from harness.perf import absolute
from harness.pipelines.sessions import Session, generate
from harness.ranks import PoolSet, run_on_ranks
from harness.targets.diffusers_pipeline import CPU_REASON, DiffusersPipelineTarget, describe
from harness.targets.spec import TargetSpec
from tests.targets.tiny_flux import save_tiny_flux

pytestmark = pytest.mark.timeout(300)

FIELDS = {"prompt": "a red fox", "height": 32, "width": 32, "num_inference_steps": 3, "max_sequence_length": 16}


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_flux(tmp_path_factory.mktemp("tiny_flux"))


@pytest.fixture(scope="module")
def pools() -> PoolSet:
    with PoolSet("cpu") as shared:
        yield shared


def _case(path: Path, **fields: object) -> ImageCase:
    return ImageCase(
        "flux",
        kind="image",
        world_size=1,
        ulysses_degree=1,
        ring_degree=1,
        fields={**FIELDS, **fields},
        target=TargetSpec("diffusers", (("path", str(path)),)),
        source="<test>",
    )


@pytest.mark.parametrize(
    ("change", "key", "message"),
    [
        (
            {"num_steps": 3},
            "num_steps",
            r"unknown key: neither a parity field nor a parameter of FluxPipeline.__call__; valid: path, ",
        ),
        ({"output_type": "pil"}, "output_type", "set by parity"),
        ({"device": "cuda"}, "device", "set by the runner"),
        ({"prompt": None}, "prompt", "required: a string"),
        ({"seed": 1.5}, "seed", "expected an int"),
        ({"dtype": "fp8"}, "dtype", "expected one of float32, bfloat16, float16"),
        ({"num_inference_steps": 0}, "num_inference_steps", "positive int"),
        ({"path": "/nonexistent"}, "path", "not a saved diffusers pipeline"),
    ],
)
def test_fields_are_checked_naming_the_key(flux: Path, change: dict, key: str, message: str) -> None:
    fields = {k: v for k, v in {**FIELDS, **change}.items() if v is not None}
    with pytest.raises(ParamError, match=message) as info:
        DiffusersPipelineTarget(str(flux)).check_case(fields, 1)
    assert info.value.key == key


def test_kind_path_and_context_parallel_plan(flux: Path, tmp_path: Path) -> None:
    target = DiffusersPipelineTarget()
    with pytest.raises(ParamError, match="no pipeline directory") as info:
        target.check_case(FIELDS, 1)
    assert info.value.key == "path"
    assert target.check_case({**FIELDS, "path": str(flux), "guidance_scale": 3.5}, 2) == "image"  # Flux has a _cp_plan
    # the same directory declaring a transformer without a CP plan (only the configs are read)
    copy = tmp_path / "no_cp"
    (copy / "transformer").mkdir(parents=True)
    shutil.copy(flux / "model_index.json", copy)
    config = json.loads((flux / "transformer" / "config.json").read_text())
    (copy / "transformer" / "config.json").write_text(json.dumps({**config, "_class_name": "ZImageTransformer2DModel"}))
    assert not describe(str(copy)).has_cp_plan and describe(str(flux)).has_cp_plan
    assert target.check_case({**FIELDS, "path": str(copy)}, 1) == "image"
    with pytest.raises(ParamError, match="ZImageTransformer2DModel has no _cp_plan") as info:
        target.check_case({**FIELDS, "path": str(copy)}, 2)
    assert info.value.key == "world_size"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("model_index.json", "{"),
        ("model_index.json", "[]"),
        ("transformer/config.json", '{"a": NaN}'),
    ],
    ids=["index-malformed", "index-not-an-object", "config-nan"],
)
def test_a_damaged_saved_pipeline_is_an_error_naming_the_file(flux: Path, tmp_path: Path, name: str, text: str) -> None:
    damaged = tmp_path / "damaged"
    (damaged / "transformer").mkdir(parents=True)
    for config in ("model_index.json", "transformer/config.json"):  # only the configs are read
        shutil.copy(flux / config, damaged / config)
    (damaged / name).write_text(text)  # an error naming the file, never a traceback
    with pytest.raises(ParamError) as info:
        describe(str(damaged))
    assert info.value.key == "path" and str(damaged / name) in str(info.value)


def test_what_a_machine_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    target = DiffusersPipelineTarget()
    assert target.unavailable_reason("cpu", 1) is None
    assert target.unavailable_reason("cpu", 2) == CPU_REASON
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    assert "one GPU per rank (an NCCL device mesh); 1 visible for 2 ranks" in target.unavailable_reason("cuda", 2)


def _enable_parallelism_on_cpu(path: str) -> str:
    from diffusers import ContextParallelConfig, DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    try:
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    except ZeroDivisionError as exc:
        return f"ZeroDivisionError: {exc}"
    return "ran"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fact is about a machine without an accelerator")
def test_enable_parallelism_still_cannot_run_on_the_cpu(flux: Path) -> None:
    """The fact behind CPU_REASON. When a diffusers release makes this pass, lift the refusal."""
    assert (
        run_on_ranks(_enable_parallelism_on_cpu, str(flux), world_size=2)
        == ["ZeroDivisionError: integer modulo by zero"] * 2
    )


def test_seeded_generation_and_stage_timings_in_a_rank(flux: Path, pools: PoolSet) -> None:
    first, again = generate(_case(flux).pipeline_run, pools), generate(_case(flux).pipeline_run, pools)
    other_seed = generate(_case(flux, seed=1).pipeline_run, pools)
    assert first.output.shape == (32, 32, 3) and first.output.dtype == np.uint8 and first.output.std() > 20
    assert np.array_equal(first.output, again.output) and not np.array_equal(first.output, other_seed.output)
    assert first.backends == {
        "pipeline": "FluxPipeline",
        "transformer": "FluxTransformer2DModel",
        "attention": "native",
        "context_parallel": "none",
    }
    with Session(_case(flux).pipeline_run, pools) as session:
        session.run()
        runs = [session.run().timings for _ in range(2)]
        measured = absolute.measure(session, runs=1, warmup=0)
    for run in runs:  # one result: the two timed runs of one session
        assert list(run.stages_ms) == ["TextEncodingStage", "PreparationStage", "DenoisingStage", "DecodingStage"]
        assert all(ms > 0 for ms in run.stages_ms.values()) and len(run.denoise_step_ms) == 3
        assert sum(run.stages_ms.values()) == pytest.approx(run.e2e_ms, rel=1e-9)  # the stages partition the run
        assert run.stages_ms["DenoisingStage"] == pytest.approx(sum(run.denoise_step_ms), rel=1e-9)
        assert run.clock == "perf_counter"
    assert measured["peak_memory_kind"] in ("rss_peak", "rss_lifetime_peak") and measured["peak_memory_mb"] > 50


def test_without_diffusers_a_case_is_a_configuration_error(flux: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("harness.targets.diffusers_pipeline.installed_version", lambda: None)
    with pytest.raises(ParamError, match=r"diffusers is not installed \(pip install 'parity\[diffusers\]'\)") as info:
        DiffusersPipelineTarget(str(flux)).check_case(FIELDS, 1)
    assert info.value.key == "path"


def test_a_model_directory_is_pinned_by_its_content_not_its_location(flux: Path, tmp_path: Path) -> None:
    """A CI runner that mounts the models elsewhere gates the same cases: the fingerprint holds hashes, no path."""
    from harness.baselines.images import fingerprint
    from harness.cases.image import load_image_case_file

    target = DiffusersPipelineTarget()
    here = target.identity({**FIELDS, "path": str(flux)})
    moved = tmp_path / "mounted" / "elsewhere"
    shutil.copytree(flux, moved)
    assert (
        "path" not in here
        and str(flux) not in json.dumps(here)
        and target.identity({**FIELDS, "path": str(moved)}) == here
    )
    cases = tmp_path / "flux.toml"
    cases.write_text(
        f'[defaults]\ntarget = "diffusers"\nprompt = "a red fox"\npath = {json.dumps(str(moved))}\n'
        "height = 32\nwidth = 32\nnum_inference_steps = 3\nmax_sequence_length = 16\n[cases.flux]\n"
    )
    (case,) = load_image_case_file(cases)
    assert fingerprint(case.pinned) == fingerprint(here)  # what the manifest records and the gate compares
    weights = next(moved.rglob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    changed = target.identity({**FIELDS, "path": str(moved)})["model"]
    assert (
        changed["weights_sha256"] != here["model"]["weights_sha256"]
        and changed["config_sha256"] == here["model"]["config_sha256"]
    )


def test_loading_a_pipeline_draws_no_progress_bar(flux: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """diffusers' "Loading pipeline components" and transformers' "Loading weights" bars stay out of bless and gate."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.enable_progress_bar()  # as a fresh rank finds them, whatever ran before in this process
    transformers_logging.enable_progress_bar()
    capfd.readouterr()
    DiffusersPipelineTarget().load(flux, torch.float32, "cpu")
    err = capfd.readouterr().err
    assert "it/s" not in err and "Loading" not in err, err


def test_tiny_flux_saves_from_any_directory(tmp_path: Path) -> None:
    """The README's worked example runs the saver as a script from a project's directory, not parity's."""
    import subprocess
    import sys

    script = Path(__file__).with_name("tiny_flux.py")
    done = subprocess.run(
        [sys.executable, str(script), "flux"], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "flux" / "pipeline" / "model_index.json").is_file() and describe(
        str(tmp_path / "flux" / "pipeline")
    )
