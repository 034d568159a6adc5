"""Writing a reference set so that a kill at any moment leaves the old set or the new one complete.

No filesystem replaces several files in one step, so :func:`write_set` (1) finishes an earlier
bless killed after its commit (:func:`recover`) and removes the staging of ones killed before;
(2) stages the changed PNGs, the new manifest and the list of dropped files in a fresh
``.bless-<random>.tmp`` beside the references, each fsynced; (3) commits by renaming it to
:data:`~harness.baselines.images.PENDING`; (4) moves each file into place, then the manifest,
deletes the dropped files and removes ``PENDING``. Before (3) the old set is untouched; from (3) on
the new set is ``PENDING`` plus what was moved, which is what :mod:`harness.baselines.images` reads,
so a reader never needs this module. One bless at a time per directory: writers are not coordinated.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.baselines.images import (
    MANIFEST,
    PENDING,
    Entry,
    ManifestFormatError,
    case_of_file,
    fingerprint,
    manifest_json,
    pending_set,
    read_manifest,
    reference_files,
)
from harness.errors import ConfigError
from harness.files.atomic import dump_json, fsync_dir
from harness.files.jsonio import expect_id, read_json
from harness.files.png import encode_png
from harness.files.reading import lstat_kind

__all__ = ["Blessing", "bless", "blessing", "read_entries", "recover", "write_set"]

_DROPPED = "dropped.json"  # in a staged set: the files of the old set that the new one no longer has
_STAGING_GLOB = ".bless-*.tmp"


@dataclass(frozen=True)
class Blessing:
    """A new reference for one case: its manifest entry, its pixels and the PNG bytes of each of its files."""

    entry: Entry
    array: np.ndarray = field(repr=False)
    data: dict[str, bytes] = field(repr=False, default_factory=dict)


def blessing(
    case_id: str, array: Any, fields: Mapping[str, Any] | None = None, world_size: int = 1, pipeline: str | None = None
) -> Blessing:
    """Encode ``array`` (``HxWx3`` image or ``TxHxWx3`` video, uint8) as the reference of ``case_id``,
    generated from ``fields`` on ``world_size`` ranks of ``pipeline``."""
    array = np.asarray(array)
    if array.dtype != np.uint8 or array.ndim not in (3, 4) or array.shape[-1] != 3 or 0 in array.shape:
        raise ValueError(f"bless needs uint8 HxWx3 or TxHxWx3, got dtype {array.dtype} shape {array.shape}")
    names = reference_files(case_id, array.shape)
    frames = [array] if array.ndim == 3 else list(array)
    data = {name: encode_png(frame) for name, frame in zip(names, frames)}
    entry = Entry(
        case_id,
        {n: hashlib.sha256(b).hexdigest() for n, b in data.items()},
        None if fields is None else fingerprint(fields),
        None if fields is None else dict(fields),
        world_size,
        pipeline,
        tuple(array.shape),
    )
    return Blessing(entry, array, data)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _remove_empty_dirs(root: Path, names: Iterable[str]) -> None:
    for parent in sorted({(root / n).parent for n in names} - {root}, reverse=True):
        try:
            parent.rmdir()
        except OSError:  # not empty, or gone already
            pass


def _dropped_names(path: Path, directory: Path) -> list[str]:
    """The reference files a staged set drops, each checked to be one (``<id>.png`` or ``<id>/frame_<i>.png``)
    before anything is deleted by its name."""
    names = read_json(path, within=directory)
    if not isinstance(names, list):
        raise ConfigError("must be a JSON list of reference file names", path=path)
    for i, name in enumerate(names):
        case_id = case_of_file(name) if isinstance(name, str) else None
        if case_id is None:
            raise ConfigError(f"not a reference file name: {name!r}", path=path, key=f"[{i}]")
        expect_id(case_id, path, f"[{i}]", "reference file")
    return names


def _staged_pngs(pending: Path) -> list[str]:
    """The PNGs of a committed set, each a regular file parity staged (a symlink planted there is refused, never moved)."""
    names = []
    for folder, dirs, files in os.walk(pending):
        for name in [*dirs, *files]:
            path = Path(folder, name)
            kind = lstat_kind(path)
            if kind not in (None, "a directory"):
                raise ConfigError(f"is {kind}, not a file staged by parity bless; remove {pending}", path=path)
        names += [str(Path(folder, n).relative_to(pending)) for n in files if n.endswith(".png")]
    return sorted(names)


def recover(directory: str | Path) -> None:
    """Finish a bless killed after its commit (move the rest of :data:`PENDING` into place) and
    delete the staging folders of blesses killed before it. A no-op on a clean directory; anything
    at :data:`PENDING` that parity did not stage is a ConfigError, never moved."""
    directory = Path(directory)
    for staging in directory.glob(_STAGING_GLOB):
        shutil.rmtree(staging, ignore_errors=True)
    committed = pending_set(directory)  # refuses a symlink or a file at PENDING
    pending = directory / PENDING
    if lstat_kind(pending) == "nothing":
        return
    if committed is not None:
        for name in _staged_pngs(pending):
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(pending / name, directory / name)
        fsync_dir(directory)
        os.replace(pending / MANIFEST, directory / MANIFEST)  # from here on the set in force is in place
        fsync_dir(directory)
    dropped_list = pending / _DROPPED
    if lstat_kind(dropped_list) != "nothing":
        dropped = _dropped_names(dropped_list, directory)
        for name in dropped:
            (directory / name).unlink(missing_ok=True)
        _remove_empty_dirs(directory, dropped)
        dropped_list.unlink()
    shutil.rmtree(pending)  # only empty folders are left in it


def _holds(path: Path, digest: str) -> bool:
    """Whether ``path`` is a plain file with sha256 ``digest`` (so rewriting it would change nothing)."""
    try:
        return path.is_file() and not path.is_symlink() and hashlib.sha256(path.read_bytes()).hexdigest() == digest
    except OSError:
        return False


def read_entries(directory: Path, whole_set: bool) -> dict[str, Entry]:
    """The set's entries; none where ``whole_set`` replaces a manifest of another format."""
    try:
        return read_manifest(directory)
    except ManifestFormatError:
        if whole_set:
            return {}
        raise


def write_set(directory: str | Path, blessings: Sequence[Blessing], whole_set: bool = False) -> None:
    """Replace the references of ``blessings``' cases (others are kept) as one set: see the module docstring.
    ``whole_set``: ``blessings`` are every case's, so a manifest of an older format is replaced, not read."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    recover(directory)
    entries = read_entries(directory, whole_set)
    new = {**entries, **{b.entry.case_id: b.entry for b in blessings}}
    kept = {name for e in new.values() for name in e.files}
    dropped = sorted(
        {name for b in blessings if b.entry.case_id in entries for name in entries[b.entry.case_id].files} - kept
    )
    staging = directory / f".bless-{secrets.token_hex(6)}.tmp"
    staging.mkdir()
    try:
        for b in blessings:
            for name, data in b.data.items():
                if not _holds(directory / name, b.entry.files[name]):  # the file on disk, not the manifest's word
                    _write(staging / name, data)
        _write(staging / _DROPPED, dump_json(dropped).encode())
        _write(staging / MANIFEST, dump_json(manifest_json(new)).encode())  # last: staged means complete
        for folder in {p.parent for p in staging.rglob("*")} | {staging}:
            fsync_dir(folder)
        os.rename(staging, directory / PENDING)  # the commit
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(directory)
    recover(directory)


def bless(
    directory: str | Path,
    case_id: str,
    array: Any,
    fields: Mapping[str, Any] | None = None,
    world_size: int = 1,
    pipeline: str | None = None,
) -> list[str]:
    """Store ``array`` as the reference of ``case_id`` (one case of :func:`write_set`); the files it is stored in."""
    one = blessing(case_id, array, fields, world_size, pipeline)
    write_set(directory, [one])
    return list(one.data)
