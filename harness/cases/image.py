"""Image cases (TOML): one seeded pipeline run at a world size, compared with its single-rank reference.

Files live in ``<cases root>/images/*.toml``: optional ``[defaults]`` and one ``[cases.<id>]`` table
per case, with ``world_size``, ``ulysses_degree``, ``ring_degree``, ``kind``, ``target``,
``unmeasured`` and the pipeline target's own fields (the target says which keys are fields and
whether they can run: :meth:`PipelineTarget.check_case`). A case's reference is the same fields on
the same target on one rank, so a 1-rank case is a regression check and an N-rank case a parity
check. A case naming another target than ``--pipeline-target`` gets it built without the
``--pipeline-target-arg`` pairs. Every problem is a ConfigError naming file, case and key. The
format, with an example: docs/formats.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines.thresholds import METRICS
from harness.cases.files import load_case_directory, read_case_tables
from harness.contracts.case import CaseOrigin
from harness.contracts.params import MAX_WORLD_SIZE
from harness.errors import ConfigError, ParamError
from harness.files.jsonio import expect_id
from harness.pipelines.sessions import PipelineRun
from harness.targets.base import PipelineTarget
from harness.targets.loader import load_pipeline_target
from harness.targets.spec import REFERENCE, TargetSpec

KINDS = ("image", "video")
_PER_CASE = ("description", "world_size", "ulysses_degree", "ring_degree", "kind")
TARGET_KEY = "target"  # not a field: which pipeline target runs the case (per case or in [defaults])
# Not a field: the metrics whose bound may go unmeasured, each with the words its skip reason must hold
# (per case or in [defaults]); an unmeasured bound not pinned here fails the case.
UNMEASURED_KEY = "unmeasured"


@dataclass(frozen=True)
class ImageCase(CaseOrigin):
    """One image or video case; ``fields`` are the pipeline target's (device excluded).

    ``target`` names the pipeline target and its factory arguments: strings, so it travels to the
    ranks, which build the target from it.
    """

    kind: str
    world_size: int
    ulysses_degree: int
    ring_degree: int
    fields: dict[str, Any]
    target: TargetSpec = TargetSpec()
    unmeasured: Mapping[str, str] = dataclasses.field(default_factory=dict)
    identity: dict[str, Any] | None = (
        None  # what its reference is pinned to (PipelineTarget.identity); None: the fields
    )

    @property
    def pinned(self) -> dict[str, Any]:
        """The fields as fingerprinted and recorded with a reference: machine paths replaced by content hashes."""
        return self.fields if self.identity is None else self.identity

    @property
    def pipeline_run(self) -> PipelineRun:
        """What a stage asks of the case's pipeline target: its fields on its world size."""
        return PipelineRun(self.target, self.fields, self.world_size)

    def reference_case(self) -> ImageCase:
        """The same fields on one rank: what ``parity bless`` stores as this case's reference."""
        return dataclasses.replace(self, world_size=1, ulysses_degree=1, ring_degree=1)


def load_image_case_file(path: str | Path, pipeline: TargetSpec = REFERENCE) -> list[ImageCase]:
    """The cases of one file; ``pipeline`` runs the cases that name no ``target``."""
    path = Path(path)
    defaults, table = read_case_tables(path, "an image case")
    for key in defaults:
        if key in _PER_CASE:
            raise ConfigError("not a pipeline field: set it per case", path=path, key=f"defaults.{key}")
    return [_make_case(path, case_id, body, defaults, pipeline) for case_id, body in table.items()]


def _case_target(
    path: Path, case_id: str, body: Mapping[str, Any], defaults: Mapping[str, Any], default: TargetSpec
) -> tuple[TargetSpec, str]:
    """The case's target (its own ``target``, the file's, or the run's default; the run's factory arguments only
    with the run's target) and the key that chose it (for errors)."""
    if TARGET_KEY in body:
        spec, where = body[TARGET_KEY], f"cases.{case_id}.{TARGET_KEY}"
    elif TARGET_KEY in defaults:
        spec, where = defaults[TARGET_KEY], f"defaults.{TARGET_KEY}"
    else:
        return default, "--pipeline-target"
    if not isinstance(spec, str) or not spec:
        raise ConfigError(
            f"case '{case_id}': target must be a pipeline target name or 'module:factory', got {spec!r}",
            path=path,
            key=where,
        )
    return default if spec == default.name else TargetSpec(spec), where


def _load_target(path: Path, case_id: str, spec: TargetSpec, where: str) -> PipelineTarget:
    """The case's pipeline target; a bad spec is an error at the key that named it."""
    try:
        return load_pipeline_target(spec)
    except ConfigError as exc:
        if exc.key != "target":
            raise  # a factory argument's error names its option
        message = str(exc).removeprefix(f"key '{exc.key}': ")
        raise ConfigError(
            f"case '{case_id}': {message}", path=None if where.startswith("--") else path, key=where
        ) from None


def _make_case(
    path: Path, case_id: str, body: Any, defaults: Mapping[str, Any], default_target: TargetSpec
) -> ImageCase:
    where = f"cases.{case_id}"
    if not isinstance(body, dict):
        raise ConfigError(f"case '{case_id}' must be a table", path=path, key=where)
    expect_id(case_id, path, where)
    world, ulysses, ring = _degrees(path, case_id, body)
    description = body.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"case '{case_id}': description must be a string", path=path, key=f"{where}.description")
    target, chosen_by = _case_target(path, case_id, body, defaults, default_target)
    pipeline = _load_target(path, case_id, target, chosen_by)
    fields = {k: v for k, v in {**defaults, **body}.items() if k not in (*_PER_CASE, TARGET_KEY, UNMEASURED_KEY)}
    unmeasured = _unmeasured(path, case_id, body, defaults)
    try:
        kind = pipeline.check_case(fields, world)
    except ParamError as exc:
        note = " (value from [defaults])" if exc.key in defaults and exc.key not in body else ""
        raise ConfigError(
            f"case '{case_id}': {exc}{note}", path=path, key=f"{where}.{exc.key}" if exc.key else where
        ) from None
    declared = body.get("kind", kind)
    if declared not in KINDS or declared != kind:
        raise ConfigError(
            f"case '{case_id}': kind {declared!r} but the case makes it {kind!r}", path=path, key=f"{where}.kind"
        )
    return ImageCase(
        case_id,
        kind,
        world,
        ulysses,
        ring,
        fields,
        target,
        unmeasured,
        pipeline.identity(fields),
        source=str(path),
        description=description,
    )


def _degrees(path: Path, case_id: str, body: Mapping[str, Any]) -> tuple[int, int, int]:
    """The case's world size, Ulysses and ring degrees (Ulysses x ring = world; the pipeline's DiTs: ring 1)."""
    where = f"cases.{case_id}"

    def meta_int(key: str, default: int) -> int:
        value = body.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORLD_SIZE:
            raise ConfigError(
                f"case '{case_id}': must be a positive integer <= {MAX_WORLD_SIZE}, got {value!r}",
                path=path,
                key=f"{where}.{key}",
            )
        return value

    world = meta_int("world_size", 1)
    ring = meta_int("ring_degree", 1)
    ulysses = meta_int("ulysses_degree", world // ring if world % ring == 0 else world)
    if ulysses * ring != world:
        raise ConfigError(
            f"case '{case_id}': ulysses_degree ({ulysses}) × ring_degree ({ring}) must equal world_size ({world})",
            path=path,
            key=f"{where}.ulysses_degree",
        )
    if ring != 1:
        raise ConfigError(
            f"case '{case_id}': the pipeline's DiTs shard image tokens over Ulysses only (ring_degree must be 1)",
            path=path,
            key=f"{where}.ring_degree",
        )
    return world, ulysses, ring


def _unmeasured(path: Path, case_id: str, body: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, str]:
    """The case's pinned metric skips: ``{metric: words its skip reason holds}`` (its own, else the file's)."""
    where = f"cases.{case_id}.{UNMEASURED_KEY}" if UNMEASURED_KEY in body else f"defaults.{UNMEASURED_KEY}"
    pins = body.get(UNMEASURED_KEY, defaults.get(UNMEASURED_KEY, {}))
    if not isinstance(pins, dict):
        raise ConfigError(
            f"case '{case_id}': a table of metric = \"words of its skip reason\", got {pins!r}", path=path, key=where
        )
    for metric, words in pins.items():
        if metric not in METRICS:
            raise ConfigError(
                f"case '{case_id}': not a metric (known: {', '.join(METRICS)})", path=path, key=f"{where}.{metric}"
            )
        if not isinstance(words, str) or not words.strip():
            raise ConfigError(
                f"case '{case_id}': the words the skip reason holds, as a non-empty string, got {words!r}",
                path=path,
                key=f"{where}.{metric}",
            )
    return dict(pins)


def check_case_on(case: ImageCase, spec: TargetSpec, option: str) -> None:
    """Whether pipeline target ``spec`` (chosen by ``option``, e.g. the BASE of an A/B) runs the case's fields
    too, making the same kind; a ConfigError naming the case and the key otherwise."""
    pipeline = _load_target(Path(case.source), case.id, spec, option)
    where = f"cases.{case.id}"
    try:
        kind = pipeline.check_case(case.fields, case.world_size)
    except ParamError as exc:
        raise ConfigError(
            f"case '{case.id}' on {option} {spec.name!r}: {exc}",
            path=case.source,
            key=f"{where}.{exc.key}" if exc.key else where,
        ) from None
    if kind != case.kind:
        raise ConfigError(
            f"case '{case.id}' is {case.kind!r} but {option} {spec.name!r} makes it {kind!r}",
            path=case.source,
            key=where,
        )


def image_case_dir(cases_root: str | Path) -> Path:
    return Path(cases_root) / "images"


def is_image_only(cases_root: str | Path) -> bool:
    """A cases root with images/ and no contracts/: a project that gates images only has no contract stage."""
    return image_case_dir(cases_root).is_dir() and not (Path(cases_root) / "contracts").is_dir()


def load_image_cases(cases_root: str | Path, pipeline: TargetSpec = REFERENCE) -> list[ImageCase]:
    """Every case of every ``<cases_root>/images/*.toml``; ids must be unique across files."""
    cases = load_case_directory(image_case_dir(cases_root), lambda p: load_image_case_file(p, pipeline), "image case")
    check_pipeline_args_used(cases, pipeline)
    return cases


def check_pipeline_args_used(cases: Sequence[ImageCase], pipeline: TargetSpec) -> None:
    """``--pipeline-target-arg`` reaches only the cases that run on ``--pipeline-target``; given with none of
    ``cases`` doing so it would be ignored (a ``timeout=3`` for cases naming ``target = "command"``): refused."""
    if not pipeline.args or any(c.target.name == pipeline.name for c in cases):
        return
    named = sorted({c.target.name for c in cases})
    why = f"each names its own target ({', '.join(named)})" if named else "there are none"
    raise ConfigError(
        f"no image case runs on --pipeline-target {pipeline.name!r}: {why}, so {', '.join(k for k, _ in pipeline.args)} "
        "would be ignored; set them as case fields, or pass --pipeline-target for those cases",
        key="--pipeline-target-arg",
    )


def select_image_cases(cases: Sequence[ImageCase], ids: Sequence[str]) -> list[ImageCase]:
    """The cases named by ``ids`` (all when empty); an unknown id is a ConfigError listing the known ones."""
    known = {c.id: c for c in cases}
    for case_id in ids:
        if case_id not in known:
            raise ConfigError(f"no image case {case_id!r}; known: {', '.join(known)}", key="CASE")
    return [c for c in cases if not ids or c.id in ids]
