"""Blessing: new references for image cases, shown old → new before anything is written.

The only writer of reference images. New references come either from running each case's
fields on one rank of the case's own pipeline target (:func:`generate_blessings`,
:meth:`ImageCase.reference_case`; the manifest records that target) or from the
candidates a gate run saved (:func:`blessings_from_results`, the ``--force-regen`` workflow of
pytest-regressions: regenerate from the run that failed, review, commit). :func:`changes` says
what each would change (hash, PSNR between old and new, which fields moved), and
:func:`harness.baselines.image_writes.write_set` writes them all as one set or not at all.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.baselines.image_writes import Blessing, blessing
from harness.baselines.images import (
    MANIFEST,
    ManifestFormatError,
    changed_fields,
    find_reference,
    fingerprint,
    read_manifest,
)
from harness.cases.image import ImageCase
from harness.errors import ConfigError
from harness.files.jsonio import read_json
from harness.files.reading import lstat_kind
from harness.gate.images import CANDIDATES_DIR, nonfinite_reason
from harness.pipelines.sessions import generate
from harness.project.hints import command
from harness.ranks import PoolSet
from harness.report.format import psnr_text
from harness.results import FAILED, stage_records
from harness.targets.loader import load_pipeline_target


@dataclass(frozen=True)
class Change:
    """What blessing one case changes. ``psnr`` is between the old and the new pixels (inf: identical;
    None: nothing to compare, a new case or a new shape)."""

    case_id: str
    kind: str  # "new", "changed", "unchanged", "repaired" (the old reference was unreadable)
    old_digest: str | None
    new_digest: str
    psnr: float | None
    fields: list[str]  # what changed in the fields since the old reference was blessed, or why it was unreadable
    shape: str

    def cells(self) -> tuple[str, ...]:
        """Its row of ``parity bless``'s table, under :data:`CHANGE_HEADERS`."""
        return (
            self.case_id,
            self.kind,
            self.shape,
            (self.old_digest or "-")[:12],
            self.new_digest[:12],
            psnr_text(self.psnr),
            "; ".join(self.fields) or "-",
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "case_id": self.case_id,
            "change": self.kind,
            "shape": self.shape,
            "old_sha256": self.old_digest,
            "new_sha256": self.new_digest,
            "psnr_old_vs_new": None if self.psnr is None else ("inf" if math.isinf(self.psnr) else self.psnr),
            "fields_changed": self.fields,
        }


CHANGE_HEADERS = ("case", "change", "shape", "old sha256", "new sha256", "psnr old vs new", "fields changed")


def generate_blessings(cases: Sequence[ImageCase], pools: PoolSet, timeout: float | None = None) -> list[Blessing]:
    """Run every case's fields on one rank of its pipeline target; cases sharing target and fields (1-rank and
    N-rank of one prompt) share one run.

    A case whose target cannot run here is refused before anything runs, and a run that produced
    NaN/Inf is refused (ConfigError naming the case; nothing is written): its uint8 pixels would
    store a black image that every equally broken run then matches.
    """
    references = [case.reference_case() for case in cases]
    for reference in references:
        reason = reference.pipeline_run.unavailable(pools.device)
        if reason:
            raise ConfigError(
                f"its pipeline target {reference.target.name!r} cannot run here: {reason}",
                path=reference.source,
                key=f"cases.{reference.id}",
            )
    if any(r.pipeline_run.in_ranks for r in references):
        pools.prestart([1])
    by_run: dict[str, np.ndarray] = {}
    out = []
    for case, reference in zip(cases, references):
        key = fingerprint({"target": case.target.name, "target_args": case.target.args, "fields": case.fields})
        if key not in by_run:
            produced = generate(reference.pipeline_run, pools, timeout)
            if produced.nonfinite:
                raise ConfigError(
                    f"refusing to bless: {nonfinite_reason(produced.nonfinite)}",
                    path=case.source,
                    key=f"cases.{case.id}",
                )
            by_run[key] = produced.output
        out.append(blessing(case.id, by_run[key], case.pinned, 1, case.target.name))
    return out


def blessings_for(
    cases: Sequence[ImageCase], device: str, timeout: float | None, from_results: Path | None, carried: Sequence[str]
) -> list[Blessing]:
    """The references to write: the candidates a results folder kept, or generated now (in rank pools opened and
    closed here, after the device is checked)."""
    from harness.contracts.runner import check_device

    if from_results is not None:
        return blessings_from_results(cases, from_results, carried)
    check_device(device)
    with PoolSet(device) as pools:
        return generate_blessings(cases, pools, timeout)


def _candidates(results_dir: Path) -> Path:
    """``<results_dir>/candidates``, which must be a directory of its own (a symlink to one elsewhere is refused)."""
    directory = results_dir / CANDIDATES_DIR
    kind = lstat_kind(directory)
    if kind not in ("a directory", "nothing"):
        raise ConfigError(
            f"is {kind or 'a regular file'}, not the folder of candidates a gate run saves",
            path=directory,
            key="--from-results",
        )
    return directory


def saved_candidates(results_dir: Path, carried: Sequence[str] = ()) -> list[str]:
    """The case ids a gate run saved candidates for (``<results_dir>/candidates``); ``carried``: the options the
    gate command of the message must repeat."""
    directory = _candidates(results_dir)
    if lstat_kind(directory / MANIFEST) == "nothing":
        gate = command(["gate", "--report", str(results_dir), "--keep-outputs"], carried)
        raise ConfigError(
            f"holds no saved candidates: run `{gate}` (failing image cases save theirs, "
            "--keep-outputs saves every case's)",
            path=results_dir,
            key="--from-results",
        )
    return sorted(read_manifest(directory))


def failed_cases(results_dir: Path) -> list[str]:
    """The image cases that failed in the gate run of ``results_dir`` (from its results.json), for messages."""
    path = results_dir / "results.json"
    try:
        records = stage_records(read_json(path, within=results_dir), path)
    except ConfigError:  # unreadable: the message that wanted the names does without them
        return []
    return sorted(
        case_id for (stage, case_id), r in records.items() if stage == "images" and r.record["status"] == FAILED
    )


def blessings_from_results(
    cases: Sequence[ImageCase], results_dir: Path, carried: Sequence[str] = ()
) -> list[Blessing]:
    """The candidates a gate run saved, as new references of ``cases``; refused (nothing written) when one is unusable.

    A reference is a one-rank output, so an N-rank case takes the candidate of a one-rank case
    with the same fields from the same run; a candidate made from other fields than the case has
    now (the case file changed after that run) is refused.
    """
    directory = _candidates(results_dir)
    saved = read_manifest(directory)
    one_rank = {e.fingerprint: e.case_id for e in saved.values() if e.world_size == 1 and e.fingerprint}
    problems, out = [], []
    for case in cases:
        want = fingerprint(case.pinned)
        entry = saved.get(case.id)
        source = case.id if entry is not None and entry.world_size == 1 else one_rank.get(want)
        if entry is not None and entry.fingerprint != want:
            problems.append(
                f"{case.id}: its fields changed after that run ({'; '.join(changed_fields(entry.fields, case.pinned))})"
            )
        elif source is None and entry is None:
            problems.append(f"{case.id}: that run saved no candidate for it")
        elif source is None:
            problems.append(
                f"{case.id}: its candidate ran on {entry.world_size} ranks and a reference is a one-rank "
                f"output; no one-rank case of that run has its fields: run `{command(['bless', case.id], carried)}`"
            )
        else:
            found = find_reference(directory, source, saved)
            assert found is not None  # listed in the manifest just read
            shape = load_pipeline_target(case.target).output_shape(case.fields)
            if shape is not None and found.array.shape != shape:
                problems.append(
                    f"{case.id}: its candidate ({source}) is {list(found.array.shape)}; the case makes {list(shape)}"
                )
                continue
            out.append(blessing(case.id, found.array, case.pinned, 1, found.entry.pipeline))
    if problems:
        raise ConfigError(
            "cannot bless from that run; nothing was written:\n  " + "\n  ".join(problems),
            path=directory,
            key="--from-results",
        )
    return out


def _digest(files: dict[str, str]) -> str:
    """One hash per case: its file's, or for a video the SHA-256 of its frames' hashes in order."""
    if len(files) == 1:
        return next(iter(files.values()))
    return hashlib.sha256("".join(files.values()).encode()).hexdigest()


def _replaced(b: Blessing, why: str) -> Change:
    """A blessing over a set whose old entries cannot be read: each is shown as repaired, with the reason."""
    shape = "x".join(map(str, b.entry.shape or ()))
    return Change(b.entry.case_id, "repaired", None, _digest(b.entry.files), None, [why], shape)


def changes(directory: Path, blessings: Sequence[Blessing], whole_set: bool = False) -> list[Change]:
    """Old → new for every blessing, against the references now in ``directory``.

    An old reference that fails its check (a hash mismatch after a merge, a missing frame) is what
    blessing is for, so it is reported as ``repaired`` with the reason instead of stopping the bless.
    A manifest that cannot be read stops it here: no blessing can be written into that set, unless the
    blessing is of the whole set (``whole_set``) and the manifest is only of another format: then every
    case is shown as repaired, with that reason."""
    from harness.metrics import psnr

    try:
        manifest = read_manifest(directory)
    except ManifestFormatError as exc:
        if not whole_set:
            raise
        return [_replaced(b, str(exc)) for b in blessings]
    out = []
    for b in blessings:
        new_digest = _digest(b.entry.files)
        shape = "x".join(map(str, b.entry.shape or ()))
        try:
            old = find_reference(directory, b.entry.case_id, manifest)
        except ConfigError as exc:
            out.append(Change(b.entry.case_id, "repaired", None, new_digest, None, [str(exc)], shape))
            continue
        if old is None:
            out.append(Change(b.entry.case_id, "new", None, new_digest, None, [], shape))
            continue
        value = psnr(old.array, b.array) if old.array.shape == b.array.shape else None
        if old.array.shape != b.array.shape:
            shape = f"{'x'.join(map(str, old.array.shape))} → {shape}"
        fields = (
            changed_fields(old.entry.fields, b.entry.fields or {})
            if old.entry.fingerprint != b.entry.fingerprint
            else []
        )
        old_digest = _digest(old.entry.files)
        kind = "unchanged" if old.entry.files == b.entry.files else "changed"
        out.append(Change(b.entry.case_id, kind, old_digest, new_digest, value, fields, shape))
    return out
