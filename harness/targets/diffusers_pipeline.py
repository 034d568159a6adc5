"""The ``diffusers`` pipeline target: a ``DiffusionPipeline`` from a local directory, seeded, timed by callbacks.

The directory is a ``save_pretrained`` pipeline (``path=DIR``, or the case field ``path``), loaded
with ``local_files_only=True``: a gate never reaches a hub. Case fields are ``path``, ``seed`` (a CPU
generator: the same noise on every device and rank), ``dtype`` and any parameter of the pipeline's
``__call__``; what parity sets itself is refused. Four marks per run (CUDA events without a sync on
a GPU, so the pipeline keeps its overlap) split ``e2e_ms`` into text encoding, preparation,
denoising steps and decoding. At W ranks diffusers' own context parallelism shards the transformer
by its ``_cp_plan``; ``enable_parallelism`` cannot run on the CPU (:data:`CPU_REASON`), so W > 1
cases skip there. Fields, stages and their approximations: docs/targets/pipelines.md.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from harness.errors import ConfigError, ParamError
from harness.files.jsonio import expect_object, read_json
from harness.targets.base import PipelineOutput, PipelineTarget, Timings
from harness.targets.diffusers import NOT_INSTALLED, installed_version

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PARITY_FIELDS = ("path", "seed", "dtype")  # fields parity consumes; every other field is a __call__ argument
SET_BY_PARITY = frozenset(
    {
        "generator",
        "output_type",
        "return_dict",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "num_images_per_prompt",
        "callback",
        "callback_steps",
    }
)
_POSITIVE = ("height", "width", "num_inference_steps", "num_frames")
CPU_REASON = (
    "diffusers' enable_parallelism cannot run on the CPU: it places rank r on torch.device(<accelerator>, "
    "r % torch.accelerator.device_count()), a ZeroDivisionError with no accelerator (measured with diffusers "
    "0.42.1, ModelMixin._resolve_parallel_config); W > 1 needs --device cuda"
)


@dataclass(frozen=True)
class PipelineDir:
    """What a saved pipeline directory declares, read without loading any weight."""

    path: Path
    pipeline_class: str
    transformer_class: str | None
    call_params: frozenset[str]
    has_cp_plan: bool

    @property
    def video(self) -> bool:
        return "num_frames" in self.call_params


def _read_object(path: Path) -> dict[str, Any]:
    """A JSON object file of the saved pipeline, or a ParamError on ``path`` naming the file and why."""
    try:
        return expect_object(read_json(path), path, "")
    except ConfigError as exc:
        raise ParamError("path", str(exc)) from None


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_DIGESTS: dict[tuple[str, int, int], str] = {}  # (file, size, mtime_ns) -> sha256: one read per file per process


def _file_digest(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def model_digest(root: Path) -> dict[str, str]:
    """SHA-256 over the relative paths and contents of a pipeline directory's weight files (``weights_sha256``)
    and of every other file, its configs (``config_sha256``): what the directory holds, not where it is."""
    parts: dict[str, list[str]] = {"config_sha256": [], "weights_sha256": []}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and ".cache" not in p.relative_to(root).parts):
        kind = "weights_sha256" if path.suffix in WEIGHT_SUFFIXES else "config_sha256"
        parts[kind].append(f"{path.relative_to(root).as_posix()}\0{_file_digest(path)}")
    return {kind: hashlib.sha256("\n".join(lines).encode()).hexdigest() for kind, lines in parts.items()}


@functools.lru_cache(maxsize=32)
def describe(path: str) -> PipelineDir:
    """The pipeline class, its ``__call__`` parameters and whether its transformer has a CP plan
    (ParamError on ``path`` when the directory is not a saved diffusers pipeline)."""
    import diffusers

    root = Path(path)
    index = root / "model_index.json"
    if not index.is_file():
        raise ParamError("path", f"{root} is not a saved diffusers pipeline (no model_index.json)")
    name = _read_object(index).get("_class_name")
    cls = getattr(diffusers, str(name), None)
    if cls is None:
        raise ParamError(
            "path", f"{index}: _class_name {name!r} is not a pipeline of diffusers {diffusers.__version__}"
        )
    params = frozenset(inspect.signature(cls.__call__).parameters) - {"self"}
    if "callback_on_step_end" not in params:
        raise ParamError("path", f"{name}.__call__ takes no callback_on_step_end: parity times the steps through it")
    transformer_config = root / "transformer" / "config.json"
    transformer = _read_object(transformer_config).get("_class_name") if transformer_config.is_file() else None
    model = getattr(diffusers, str(transformer), None) if transformer else None
    return PipelineDir(root, str(name), transformer, params, getattr(model, "_cp_plan", None) is not None)


def _check_values(fields: Mapping[str, Any]) -> None:
    if not isinstance(fields.get("prompt"), str):
        raise ParamError("prompt", f"required: a string, got {fields.get('prompt')!r}")
    seed = fields.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ParamError("seed", f"expected an int, got {seed!r}")
    dtype = fields.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ParamError("dtype", f"expected one of {', '.join(DTYPES)}, got {fields.get('dtype')!r}")
    for key in _POSITIVE:
        value = fields.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ParamError(key, f"expected a positive int, got {value!r}")


class DiffusersPipelineTarget(PipelineTarget):
    """A saved diffusers pipeline. Subclass and override :meth:`load` to build it another way (or to plant a fault)."""

    name = "diffusers"

    def __init__(self, path: str | None = None) -> None:
        self.path = path

    def unavailable_reason(self, device: str, world_size: int = 1) -> str | None:
        """W > 1 only: where diffusers' context parallelism cannot run (diffusers missing is a case error, in check_case)."""
        if world_size == 1:
            return None
        if device == "cpu":
            return CPU_REASON
        gpus = torch.cuda.device_count()
        if gpus < world_size:
            return f"diffusers' context parallelism needs one GPU per rank (an NCCL device mesh); {gpus} visible for {world_size} ranks"
        return None

    def _dir(self, fields: Mapping[str, Any]) -> PipelineDir:
        path = fields.get("path", self.path)
        if not isinstance(path, str) or not path:
            raise ParamError("path", "no pipeline directory: give --pipeline-target-arg path=DIR or a case field path")
        if installed_version() is None:
            raise ParamError("path", NOT_INSTALLED)
        return describe(str(Path(path).resolve()))

    def check_case(self, fields: Mapping[str, Any], world_size: int) -> str:
        if "device" in fields:
            raise ParamError("device", "set by the runner (--device), not by a case")
        info = self._dir(fields)
        for key in fields:
            if key in SET_BY_PARITY:
                raise ParamError(key, "set by parity, not by a case")
            if key not in PARITY_FIELDS and key not in info.call_params:
                valid = ", ".join((*PARITY_FIELDS, *sorted(info.call_params - SET_BY_PARITY)))
                raise ParamError(
                    key,
                    f"unknown key: neither a parity field nor a parameter of {info.pipeline_class}.__call__; "
                    f"valid: {valid}",
                )
        _check_values(fields)
        if world_size > 1 and not info.has_cp_plan:
            raise ParamError(
                "world_size",
                f"{info.transformer_class or 'the pipeline'} has no _cp_plan: diffusers cannot "
                f"split it over {world_size} ranks",
            )
        return "video" if info.video else "image"

    def identity(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The fields without ``path``, plus the content hashes of the pipeline directory it (or the factory's) names."""
        out = {k: v for k, v in fields.items() if k != "path"}
        out["model"] = model_digest(self._dir(fields).path)
        return out

    def load(self, path: Path, dtype: torch.dtype, device: str) -> DiffusionPipeline:
        """The pipeline on ``device``, from the directory only (no hub), without the loaders' progress bars
        (diffusers' and transformers' own tqdm bars would interleave with parity's on every rank)."""
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
        try:
            from transformers.utils import logging as transformers_logging
        except ImportError:  # a pipeline without transformers components
            pass
        else:
            transformers_logging.disable_progress_bar()
        pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=dtype, local_files_only=True).to(device)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def prepare(self, fields: Mapping[str, Any], device: str, world_size: int | None = None) -> _Prepared:
        info = self._dir(fields)
        pipe = self.load(info.path, DTYPES[fields.get("dtype", "float32")], device)
        kwargs = {k: v for k, v in fields.items() if k not in PARITY_FIELDS}
        return _Prepared(pipe, info, kwargs, int(fields.get("seed", 0)), device)


@dataclass
class _Clock:
    """The marks of one run (module docstring): CUDA events on ``cuda_device``, else ``perf_counter`` readings."""

    cuda_device: str | None
    text: list[tuple[Any, Any]] = field(default_factory=list)
    first_forward: Any = None
    step_ends: list[Any] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "cuda_events (stages), perf_counter (e2e)" if self.cuda_device else "perf_counter"

    def mark(self) -> Any:
        if self.cuda_device is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) if self.cuda_device else (end - start) * 1000

    def reset(self) -> None:
        self.text, self.first_forward, self.step_ends = [], None, []

    def wrap_text_encoding(self, encode: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(encode)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.mark()
            try:
                return encode(*args, **kwargs)
            finally:
                self.text.append((start, self.mark()))

        return timed

    def on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.first_forward is None:
            self.first_forward = self.mark()

    def on_step_end(self, pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        self.step_ends.append(self.mark())
        return {}  # nothing replaced: the pipeline keeps its own tensors

    def timings(self, start: Any, end: Any, wall_ms: float) -> Timings:
        """The run's stages from its marks (every event has completed: the caller synchronised)."""
        if self.first_forward is None or not self.step_ends:
            raise RuntimeError(
                "the pipeline reported no denoising step (no transformer forward or no callback_on_step_end)"
            )
        marks = [self.first_forward, *self.step_ends]
        steps = [self.ms(a, b) for a, b in zip(marks, marks[1:])]
        text = sum(self.ms(a, b) for a, b in self.text)
        stages = {"TextEncodingStage": text} if self.text else {}
        stages.update(
            PreparationStage=self.ms(start, self.first_forward) - text,
            DenoisingStage=sum(steps),
            DecodingStage=self.ms(self.step_ends[-1], end),
        )
        return Timings(wall_ms, stages, steps, self.name)


def _to_uint8(result: Any, video: bool) -> tuple[np.ndarray, int]:
    """diffusers' ``numpy_to_pil`` rounding of the first output (``[H, W, 3]`` or ``[T, H, W, 3]``) and its
    NaN/Inf count (diffusers' clamp to [0, 1] keeps NaN; uint8 would hide it as 0)."""
    batch = np.asarray(result.frames if video else result.images)
    out = np.asarray(batch[0])
    if out.ndim != (4 if video else 3) or out.shape[-1] != 3:
        raise RuntimeError(
            f"the pipeline returned {batch.shape}, not a batch of {'frames' if video else 'images'} with 3 channels"
        )
    nonfinite = int(np.count_nonzero(~np.isfinite(out)))
    return (np.nan_to_num(out, nan=0.0) * 255).round().clip(0, 255).astype(np.uint8), nonfinite


def _attention_backend(model: torch.nn.Module) -> str:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    for module in model.modules():
        backend = getattr(getattr(module, "processor", None), "_attention_backend", None)
        if backend is not None:
            return str(getattr(backend, "value", backend))
    return str(_AttentionBackendRegistry.get_active_backend()[0].value)


class _Prepared:
    """The pipeline loaded once (context parallelism over the group when W > 1); ``run()`` generates."""

    def __init__(
        self, pipe: DiffusionPipeline, info: PipelineDir, kwargs: dict[str, Any], seed: int, device: str
    ) -> None:
        import torch.distributed as dist

        self.pipe, self.info, self.kwargs, self.seed = pipe, info, kwargs, seed
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            from diffusers import ContextParallelConfig

            pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        self.device = device
        self.clock = _Clock(device if device.startswith("cuda") else None)
        if hasattr(pipe, "encode_prompt"):
            pipe.encode_prompt = self.clock.wrap_text_encoding(pipe.encode_prompt)
        self.hook = pipe.transformer.register_forward_pre_hook(self.clock.on_forward)
        self.backends = {
            "pipeline": info.pipeline_class,
            "transformer": type(pipe.transformer).__name__,
            "attention": _attention_backend(pipe.transformer),
            "context_parallel": f"ulysses={world}" if world > 1 else "none",
        }

    def run(self) -> PipelineOutput:
        self.clock.reset()
        if self.clock.cuda_device:
            torch.cuda.synchronize(self.device)  # the run's wall clock starts with an idle device
        wall_start = time.perf_counter()
        start = self.clock.mark()
        result = self.pipe(
            **self.kwargs,
            generator=torch.Generator("cpu").manual_seed(self.seed),
            output_type="np",
            return_dict=True,
            callback_on_step_end=self.clock.on_step_end,
        )
        end = self.clock.mark()
        if self.clock.cuda_device:
            torch.cuda.synchronize(self.device)
        wall_ms = (time.perf_counter() - wall_start) * 1000 if self.clock.cuda_device else self.clock.ms(start, end)
        output, nonfinite = _to_uint8(result, self.info.video)
        return PipelineOutput(output, self.clock.timings(start, end, wall_ms), dict(self.backends), nonfinite)

    def close(self) -> None:
        self.hook.remove()


def factory(path: str | None = None) -> DiffusersPipelineTarget:
    return DiffusersPipelineTarget(path)
