"""Image cases (TOML): one seeded pipeline run at a world size, compared with its single-rank reference.

Files live in ``<cases root>/images/*.toml``. A file holds optional ``[defaults]`` (pipeline
fields shared by its cases) and one table per case, keyed by its id::

    [defaults]
    prompt = "a red fox in fresh snow"
    height = 32
    width = 32
    steps = 4

    [cases.zimage_t2i_2ranks]
    description = "SP=2 must reproduce the 1-rank image"   # optional
    world_size = 2          # ranks (default 1)
    ulysses_degree = 2      # default world_size / ring_degree
    ring_degree = 1         # default 1
    kind = "image"          # optional: "image" or "video", checked against num_frames
    seed = 0                # every other key is a reference_impl.pipeline.PipelineConfig field

    [cases.hunyuan_t2v_2ranks]
    world_size = 2
    num_frames = 3          # frames make a video case (HunyuanVideo style DiT)

The reference of every case is the output of the same pipeline config on ONE rank (blessed by
``parity bless``): a 1-rank case is then a regression check, an N-rank case a parity check.
``device`` is not a case key: the runner sets it per rank (``--device``).

Every problem (TOML syntax, a key PipelineConfig does not have, a wrong type, a token count the
world size does not divide, a ring degree the pipeline cannot run) is a ConfigError naming the
file, the case and the key (``cases.<id>.<key>``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from harness.baselines.images import _check_case_id
from harness.case_files import load_case_directory, read_case_tables
from harness.errors import ConfigError
from reference_impl.models.layers import ModelConfigError
from reference_impl.pipeline import PIXELS_PER_DIT_TOKEN, PipelineConfig, PipelineResult, run_pipeline_sequence_parallel

KINDS = ("image", "video")
_META = ("description", "world_size", "ulysses_degree", "ring_degree", "kind")
_RUNNER_KEYS = ("device",)  # set by the runner, never by a case


class PoolGetter(Protocol):
    def __call__(self, world: int) -> Any: ...


@dataclass(frozen=True)
class ImageCase:
    """One image or video case; ``pipeline`` holds the PipelineConfig fields (device excluded)."""

    id: str
    kind: str
    world_size: int
    ulysses_degree: int
    ring_degree: int
    pipeline: dict[str, Any]
    source: str
    description: str = ""

    def config(self, device: str = "cpu") -> PipelineConfig:
        """The PipelineConfig of this case on ``device`` (a rank replaces it with its own device)."""
        return PipelineConfig(**self.pipeline, device=device)

    def reference_case(self) -> ImageCase:
        """The same pipeline on one rank: what ``parity bless`` stores as this case's reference."""
        return dataclasses.replace(self, world_size=1, ulysses_degree=1, ring_degree=1)


def load_image_case_file(path: str | Path) -> list[ImageCase]:
    path = Path(path)
    defaults, table = read_case_tables(path, "an image case")
    for key in defaults:
        if key in _META or key in _RUNNER_KEYS:
            raise ConfigError("not a pipeline field: set it per case" if key in _META else "set by the runner (--device), not by a case",
                              path=path, key=f"defaults.{key}")
    return [_make_case(path, case_id, body, defaults) for case_id, body in table.items()]


def _make_case(path: Path, case_id: str, body: Any, defaults: dict[str, Any]) -> ImageCase:
    where = f"cases.{case_id}"
    if not isinstance(body, dict):
        raise ConfigError(f"case '{case_id}' must be a table", path=path, key=where)
    try:
        _check_case_id(case_id)
    except ConfigError as exc:
        raise ConfigError(str(exc).split(": ", 1)[-1], path=path, key=where) from None

    def meta_int(key: str, default: int) -> int:
        value = body.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"case '{case_id}': must be a positive integer, got {value!r}", path=path, key=f"{where}.{key}")
        return value

    world = meta_int("world_size", 1)
    ring = meta_int("ring_degree", 1)
    ulysses = meta_int("ulysses_degree", world // ring if world % ring == 0 else world)
    if ulysses * ring != world:
        raise ConfigError(f"case '{case_id}': ulysses_degree ({ulysses}) × ring_degree ({ring}) must equal world_size ({world})",
                          path=path, key=f"{where}.ulysses_degree")
    if ring != 1:
        raise ConfigError(f"case '{case_id}': the pipeline's DiTs shard image tokens over Ulysses only (ring_degree must be 1)",
                          path=path, key=f"{where}.ring_degree")
    description = body.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"case '{case_id}': description must be a string", path=path, key=f"{where}.description")
    pipeline = {**defaults, **{k: v for k, v in body.items() if k not in _META}}
    for key in _RUNNER_KEYS:
        if key in pipeline:
            raise ConfigError(f"case '{case_id}': set by the runner (--device), not by a case", path=path, key=f"{where}.{key}")
    try:
        config = PipelineConfig.from_dict(pipeline)
    except ModelConfigError as exc:
        note = " (value from [defaults])" if exc.key in defaults and exc.key not in body else ""
        raise ConfigError(f"case '{case_id}': {exc.args[0].split(': ', 1)[-1]}{note}", path=path,
                          key=f"{where}.{exc.key}" if exc.key else where) from None
    kind = "image" if config.num_frames is None else "video"
    declared = body.get("kind", kind)
    if declared not in KINDS or declared != kind:
        raise ConfigError(f"case '{case_id}': kind {declared!r} but num_frames={config.num_frames} makes it {kind!r}",
                          path=path, key=f"{where}.kind")
    tokens = (config.height // PIXELS_PER_DIT_TOKEN) * (config.width // PIXELS_PER_DIT_TOKEN) * (config.num_frames or 1)
    if tokens % world:
        raise ConfigError(f"case '{case_id}': {tokens} image tokens ({config.height}x{config.width}"
                          f"{f'x{config.num_frames} frames' if config.num_frames else ''}) do not divide by world_size {world}",
                          path=path, key=f"{where}.world_size")
    return ImageCase(case_id, kind, world, ulysses, ring, pipeline, str(path), description)


def image_case_dir(cases_root: str | Path) -> Path:
    return Path(cases_root) / "images"


def load_image_cases(cases_root: str | Path) -> list[ImageCase]:
    """Every case of every ``<cases_root>/images/*.toml``; ids must be unique across files."""
    return load_case_directory(image_case_dir(cases_root), load_image_case_file, "image case")


def select_image_cases(cases: list[ImageCase], ids: list[str]) -> list[ImageCase]:
    """The cases named by ``ids`` (all when empty); an unknown id is a ConfigError listing the known ones."""
    known = {c.id: c for c in cases}
    for case_id in ids:
        if case_id not in known:
            raise ConfigError(f"no image case {case_id!r}; known: {', '.join(known)}", key="CASE")
    return [c for c in cases if not ids or c.id in ids]


def run_pipeline_on_rank(config: PipelineConfig) -> PipelineResult | None:
    """Rank worker: the pipeline on this rank's own device under SP = world size; rank 0 returns the result.

    Module level so a RankPool can pickle a reference to it. The device must be the rank's
    (``rank_device()``: one GPU per rank, or the shared one), not the parent's.
    """
    from harness.launcher import rank_device

    result = run_pipeline_sequence_parallel(dataclasses.replace(config, device=str(rank_device())))
    return result if result.sp_rank == 0 else None


def run_image_case(case: ImageCase, pools: PoolGetter, device: str = "cpu", timeout: float | None = None) -> PipelineResult:
    """Run ``case`` on ``case.world_size`` ranks of a live pool (``pools(world)``) and return rank 0's result.

    One rank runs in a 1-rank pool too, so every case (and its reference) runs in the same
    process setup (a rank's thread count, its device) and only the SP degree differs.
    """
    results = pools(case.world_size).run(run_pipeline_on_rank, case.config(device), timeout=timeout)
    return results[0]
