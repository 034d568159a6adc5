"""What a run concluded: one result type for every case of every stage, and the results.json that records it.

A contract case, an image case and a perf scenario all end as a :class:`CaseResult` (status,
figures, the bound as text, the reason, the kernel that ran, the duration); every summary, table,
JUnit row and HTML section is computed from these, so no stage counts or formats on its own. This
module is the one owner of the results document (``--json``, ``--report``: its keys in
docs/formats.md). :func:`parse_results` validates what :mod:`harness.recalibrate` reads back
(``cases``, ``perf``, ``platform``), :func:`stage_records` what ``compare``, ``bless
--from-results`` and ``matrix`` read; a key parity does not write is refused, naming the nearest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

from harness.errors import ConfigError
from harness.files.jsonio import expect_id, expect_known_keys, expect_object, expect_str, join_key, read_json
from harness.targets.base import Refused
from harness.targets.spec import TargetSpec


class Status(StrEnum):
    """A case's outcome. ``XFAILED``: a known upstream divergence failed as recorded (not a regression).
    ``INCONCLUSIVE``: a timing verdict the runs could not decide (neither verified nor a regression).
    ``NOT_APPLICABLE``: the case needs what the target does not claim to do (a capability it does not declare):
    counted and shown, never a pass and never a failure."""

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    XFAILED = "xfailed"
    INCONCLUSIVE = "inconclusive"
    NOT_APPLICABLE = "not_applicable"


PASSED, FAILED, SKIPPED, XFAILED, INCONCLUSIVE, NOT_APPLICABLE = (
    Status.PASSED,
    Status.FAILED,
    Status.SKIPPED,
    Status.XFAILED,
    Status.INCONCLUSIVE,
    Status.NOT_APPLICABLE,
)
#: The statuses of a case that was checked (a skip checked nothing).
RAN = frozenset({PASSED, FAILED, XFAILED, INCONCLUSIVE})
#: A run's verdict as a process exit code: 0 passed, 1 failed (a regression), 2 empty (no case ran: as a usage or
#: configuration error, since the selection, target or machine leaves nothing to check), 3 inconclusive (nothing
#: failed, but a verdict could not be decided and the run counts that against itself).
EXIT_CODES = {"passed": 0, "failed": 1, "empty": 2, "inconclusive": 3}


@dataclass
class CaseResult:
    """One case's conclusion. ``check`` names what judged it: a contract id, ``images.<kind>`` or ``perf.<kind>``.

    ``figures`` are JSON-safe once :meth:`to_dict` has run (non-finite floats become strings);
    ``artifacts`` are files written for it, relative to the report directory (a triptych PNG);
    ``next_step`` is the command that shows (or, for a stale reference, fixes) a failing case.
    """

    case_id: str
    check: str
    status: Status
    reason: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    bound: str = ""
    kernel: str | None = None
    duration_s: float = 0.0
    params: dict[str, Any] = field(default_factory=dict)
    target: str = "reference"
    traceback: str | None = None
    artifacts: dict[str, str] = field(default_factory=dict)
    next_step: str | None = None
    refusal: Refused | None = None  # a skip's typed cause (what a pinned skip is matched on)

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def world_size(self) -> int:
        return int(self.params.get("world_size", 1))

    def to_dict(self) -> dict[str, Any]:
        return {
            "case_id": self.case_id,
            "check": self.check,
            "status": str(self.status),
            "reason": self.reason,
            "figures": json_safe(self.figures),
            "bound": self.bound,
            "kernel": self.kernel,
            "duration_s": self.duration_s,
            "params": json_safe(self.params),
            "target": self.target,
            "traceback": self.traceback,
            "artifacts": dict(self.artifacts),
            "next_step": self.next_step,
            "refusal": self.refusal.to_dict() if self.refusal else None,
        }


#: The keys of a record (:meth:`CaseResult.to_dict`): a results file's record with another key is not parity's.
RECORD_KEYS = tuple(f.name for f in fields(CaseResult))
#: Every top-level key a results document has (:func:`environment`, :func:`results_document` and the stages'
#: ``top_level``): one that is none of them is a misspelling or a hand edit, refused when the file is read.
DOCUMENT_KEYS = (
    "command",
    "target",
    "target_args",
    "target_version",
    "device",
    "platform",
    "torch",
    "python",
    "host",
    "parity_version",
    "git",
    "project",
    "wall_s",
    "passed",
    "verdict",
    "stages",
    "cases",
    "device_name",
    "perf",
)
#: The keys of an image case's entry in ``cases`` (:func:`image_entry`).
IMAGE_ENTRY_KEYS = ("kind", "passed", "metrics", "thresholds", "threshold_source", "skipped_metrics", "world_size")


def json_safe(value: Any) -> Any:
    """Non-finite floats as strings ("nan", "inf"), at any depth: strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def counts(results: Iterable[CaseResult]) -> dict[str, int]:
    """``{status: how many}`` over every status (zeros included), in :class:`Status` order."""
    tally = dict.fromkeys((str(s) for s in Status), 0)
    for result in results:
        tally[str(result.status)] += 1
    return tally


def summary_line(results: Iterable[CaseResult], wall_s: float | None = None) -> str:
    """``3 passed, 1 failed, 0 skipped`` (+ ``, 2 xfailed``, ``, 1 inconclusive``, ``, 5 not applicable`` when any)
    ``in 4.2 s``
    (+ ``; clip not measured in 3 cases (why)`` for each bound some case skipped)."""
    results = list(results)
    tally = counts(results)
    parts = [f"{tally[s]} {s}" for s in (PASSED, FAILED, SKIPPED)]
    if tally[XFAILED]:
        parts.append(f"{tally[XFAILED]} {XFAILED} (known upstream divergences)")
    if tally[INCONCLUSIVE]:
        parts.append(f"{tally[INCONCLUSIVE]} {INCONCLUSIVE}")
    if tally[NOT_APPLICABLE]:
        parts.append(f"{tally[NOT_APPLICABLE]} not applicable")
    line = ", ".join(parts) + (f" in {wall_s:.1f} s" if wall_s is not None else "")
    return line + "".join(
        f"; {metric} not measured in {n} case{'s' if n > 1 else ''} ({why})"
        for (metric, why), n in metric_skips(results).items()
    )


def metric_skips(results: Iterable[CaseResult]) -> dict[tuple[str, str], int]:
    """How many cases skipped each bound, by metric and reason: a bound that was not measured is never a pass."""
    tally: dict[tuple[str, str], int] = {}
    for result in results:
        for metric, why in (result.figures.get("skipped_metrics") or {}).items():
            tally[metric, why] = tally.get((metric, why), 0) + 1
    return tally


# ----------------------------------------------------------------------------- the document


@dataclass
class StageResult:
    """One gate stage's results; ``extra`` goes into its section, ``top_level`` into the document root."""

    name: str
    results: list[CaseResult]
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    top_level: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return counts(self.results)[FAILED]

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": counts(self.results),
            "wall_s": self.wall_s,
            "records": [r.to_dict() for r in self.results],
            **json_safe(self.extra),
        }


def git_state(directory: str | Path) -> dict[str, Any]:
    """The commit checked out in ``directory`` and whether tracked files differ from it (both None outside a
    git checkout): the history key of a results file, as asv keys its history by commit."""
    import subprocess

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def environment(
    target: TargetSpec, device: str, target_version: str | None = None, project: Path | None = None
) -> dict[str, Any]:
    """Where and on what a run happened: what every results document records next to its results
    (``git``: the checkout of the working directory, which is the tree under test; ``project``: the
    project file in effect, None when parity's own cases and baselines ran)."""
    import platform

    import torch

    from harness.paths import parity_version
    from reference_impl.platform import current_platform

    return {
        "target": target.name,
        "target_args": dict(target.args),
        "target_version": target_version,
        "device": device,
        "platform": current_platform.label(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "parity_version": parity_version(),
        "git": git_state(Path.cwd()),
        "project": None if project is None else str(project),
    }


def verdict(results: Iterable[CaseResult], inconclusive_fails: bool = True) -> str:
    """A key of :data:`EXIT_CODES`: ``failed`` if any case failed, else ``empty`` if no case ran (every one
    skipped or not applicable, or none selected), else ``inconclusive`` if any timing was undecided (and that counts), else
    ``passed``."""
    statuses = {r.status for r in results}
    if FAILED in statuses:
        return "failed"
    if not statuses & RAN:
        return "empty"
    return "inconclusive" if inconclusive_fails and INCONCLUSIVE in statuses else "passed"


def results_document(
    command: str,
    environment: Mapping[str, Any],
    stages: Mapping[str, StageResult | str],
    wall_s: float,
    inconclusive_fails: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    """The results document of a run: ``stages`` maps a stage name to its result or to why it was skipped;
    ``verdict`` as :func:`verdict` decides it, ``passed`` whether that verdict is a pass."""
    sections: dict[str, Any] = {}
    top_level: dict[str, Any] = {}
    for name, stage in stages.items():
        if isinstance(stage, str):
            sections[name] = {"skipped": stage}
            continue
        sections[name] = stage.to_dict()
        top_level.update(json_safe(stage.top_level))
    outcome = verdict((r for s in stages.values() if isinstance(s, StageResult) for r in s.results), inconclusive_fails)
    document = {
        "command": command,
        **environment,
        "wall_s": wall_s,
        "passed": outcome == "passed",
        "verdict": outcome,
        "stages": sections,
        **json_safe(extra),
        **top_level,
    }
    unknown = set(document) - set(DOCUMENT_KEYS)
    assert not unknown, f"results_document writes keys its reader refuses: {sorted(unknown)}"
    return document


def image_entry(result: CaseResult) -> dict[str, Any]:
    """An image case's entry in the document's ``cases`` map (what recalibration reads); null metrics were not measured."""
    from harness.baselines.thresholds import METRICS
    from harness.metrics import metric_to_json

    f = result.figures
    entry = {
        "kind": result.params.get("kind", "image"),
        "passed": result.status == PASSED,
        "metrics": {m: metric_to_json(f.get(m)) for m in METRICS},  # a NaN metric is refused, never written
        "thresholds": f.get("thresholds", {}),
        "threshold_source": f.get("threshold_source", {}),
        "skipped_metrics": f.get("skipped_metrics", {}),
        "world_size": result.world_size,
    }
    assert tuple(entry) == IMAGE_ENTRY_KEYS
    return entry


def parse_results(doc: Any, path: str | Path = "<memory>") -> dict[str, Any]:
    """Validate a results document and decode its image metrics (``"inf"`` -> ``float('inf')``).

    Checked: ``platform`` (optional string), ``cases`` (required: the image stage's map, every
    metric present, null when skipped, within the values it can take: psnr -5 or ssim 5 is a
    corrupt file, not a measurement) and ``perf`` (optional: measured scenarios, finite times).
    Idempotent: a parsed document parses to itself.
    """
    from harness.baselines.perf import validate_scenario
    from harness.baselines.thresholds import KINDS, METRICS, check_metric
    from harness.metrics import metric_from_json

    doc = expect_object(doc, path, "")
    expect_known_keys(doc, DOCUMENT_KEYS, path, "")
    out = dict(doc)
    if "platform" in doc:
        expect_str(doc["platform"], path, "platform")
    if "cases" not in doc:
        raise ConfigError(
            "missing required key (the image stage's map; {} when there were no image cases)", path=path, key="cases"
        )
    cases = {}
    for case_id, case in expect_object(doc["cases"], path, "cases").items():
        case_path = join_key("cases", case_id)
        expect_id(case_id, path, case_path)
        case = expect_object(case, path, case_path)
        expect_known_keys(case, IMAGE_ENTRY_KEYS, path, case_path)
        for key in ("kind", "passed", "metrics"):
            if key not in case:
                raise ConfigError(f"missing required key '{key}'", path=path, key=case_path)
        if case["kind"] not in KINDS:
            raise ConfigError(f"kind must be one of {list(KINDS)}", path=path, key=join_key(case_path, "kind"))
        if not isinstance(case["passed"], bool):
            raise ConfigError("passed must be true or false", path=path, key=join_key(case_path, "passed"))
        raw_metrics = expect_object(case["metrics"], path, join_key(case_path, "metrics"))
        metrics = {}
        for metric in METRICS:
            key = join_key(join_key(case_path, "metrics"), metric)
            if metric not in raw_metrics:
                raise ConfigError("missing metric (write null when it was skipped)", path=path, key=key)
            metrics[metric] = check_metric(metric, metric_from_json(raw_metrics[metric], path, key), path, key)
        cases[case_id] = {**case, "metrics": metrics}
    out["cases"] = cases
    if "perf" in doc:
        for scenario_id, measured in expect_object(doc["perf"], path, "perf").items():
            expect_id(scenario_id, path, join_key("perf", scenario_id), "scenario id")
            validate_scenario(measured, path, join_key("perf", scenario_id))
    return out


class StageRecord(NamedTuple):
    """One record of a results document and its key path there (``stages.images.records[3]``), for messages."""

    key: str
    record: dict[str, Any]


def stage_records(doc: Any, path: str | Path = "<memory>") -> dict[tuple[str, str], StageRecord]:
    """``{(stage, case id): record}`` of a results document (``parity gate`` or ``parity check``), checked enough
    to compare: ``stages`` an object, each run stage's ``records`` a list of objects with a ``case_id``,
    a ``status`` and ``figures``, and no case twice in a stage (the later record would hide the earlier)."""
    doc = expect_object(doc, path, "")
    if "stages" not in doc:
        raise ConfigError(
            "missing required key 'stages' (not a results file of parity gate or parity check)", path=path
        )
    expect_known_keys(doc, DOCUMENT_KEYS, path, "")
    out: dict[tuple[str, str], StageRecord] = {}
    for name, stage in expect_object(doc["stages"], path, "stages").items():
        stage = expect_object(stage, path, join_key("stages", name))
        records = stage.get("records", [])
        if not isinstance(records, list):
            raise ConfigError("must be a list", path=path, key=join_key(join_key("stages", name), "records"))
        for i, record in enumerate(records):
            key = f"{join_key(join_key('stages', name), 'records')}[{i}]"
            record = expect_object(record, path, key)
            expect_known_keys(record, RECORD_KEYS, path, key)
            case_id = expect_str(record.get("case_id"), path, join_key(key, "case_id"))
            if record.get("status") not in tuple(str(s) for s in Status):
                raise ConfigError(
                    f"status must be one of {[str(s) for s in Status]}", path=path, key=join_key(key, "status")
                )
            expect_object(record.get("figures", {}), path, join_key(key, "figures"))
            if (name, case_id) in out:
                raise ConfigError(
                    f"a second record of case {case_id!r} (the first is {out[(name, case_id)].key})",
                    path=path,
                    key=join_key(key, "case_id"),
                )
            out[(name, case_id)] = StageRecord(key, record)
    return out


def load_results(path: str | Path) -> dict[str, Any]:
    """Read and validate a results file; any problem is a ConfigError naming the file."""
    return parse_results(read_json(path), path)


def write_results(path: str | Path, document: Mapping[str, Any]) -> None:
    """Write a results document atomically."""
    from harness.files.atomic import write_json_atomic

    write_json_atomic(path, document)
