"""Reference images and videos: a set of cases pinned by one manifest of SHA-256 hashes and case fingerprints.

A reference is trusted only if its bytes hash to the manifest entry (hash and decode read the same
bytes, as regular files inside the set's directory, through no symlink): a gate never compares
against a reference nobody blessed. Each case records the fields it was generated from, so a case
whose fields changed is told apart from a regression (:func:`changed_fields`). Videos are one PNG
per frame, so a re-bless shows which frames moved. Writing is :mod:`.image_writes` (staged, then
one rename into :data:`PENDING`); a reader here also reads a set whose move a kill interrupted.
The layout: docs/formats.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import ConfigError
from harness.files.jsonio import expect_id, expect_known_keys, expect_object, expect_str, join_key, read_json
from harness.files.png import decode_rgb_png
from harness.files.reading import is_present, lstat_kind, read_regular_bytes

__all__ = [
    "MANIFEST",
    "PENDING",
    "REFERENCES_DIR",
    "Entry",
    "Reference",
    "changed_fields",
    "case_of_file",
    "check_case_id",
    "find_reference",
    "fingerprint",
    "load_reference",
    "read_manifest",
    "ManifestFormatError",
    "reference_files",
]

MANIFEST = "manifest.json"
REFERENCES_DIR = "images"  # <baselines>/images: reference PNGs and their manifest
PENDING = ".bless-pending"  # a committed set whose files are still being moved into place
FORMAT = 2
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FRAME_FILE = re.compile(r"frame_\d{4,}\.png")  # frame_0000.png ... as reference_files numbers them


def check_case_id(case_id: str) -> str:
    """Case ids become file names: the safe id rule of :func:`harness.files.jsonio.expect_id`."""
    return expect_id(case_id, None, "case_id")


def fingerprint(fields: Mapping[str, Any]) -> str:
    """The SHA-256 of a case's fields as canonical JSON: equal fields, equal fingerprint, whatever their order."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def changed_fields(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[str]:
    """What differs between the fields a reference was blessed from and the case's fields now: ``["seed 0 → 1"]``."""
    if old is None:
        return ["blessed before fields were recorded"]
    out = []
    for key in sorted(set(old) | set(new)):
        if key not in new:
            out.append(f"{key} {old[key]!r} removed")
        elif key not in old:
            out.append(f"{key} {new[key]!r} added")
        elif old[key] != new[key]:
            out.append(f"{key} {old[key]!r} → {new[key]!r}")
    return out


def reference_files(case_id: str, shape: tuple[int, ...]) -> list[str]:
    """The files a reference of ``shape`` is stored in: ``<id>.png``, or ``<id>/frame_<i>.png`` per video frame."""
    check_case_id(case_id)
    if len(shape) == 3:
        return [f"{case_id}.png"]
    return [f"{case_id}/frame_{i:04d}.png" for i in range(shape[0])]


def case_of_file(name: str) -> str | None:
    """The case a reference file name (as :func:`reference_files` writes them) belongs to, or None when
    ``name`` is not such a name; the case id itself is not checked here (:func:`check_case_id`)."""
    stem, slash, frame = name.partition("/")
    if not slash:
        return stem.removesuffix(".png") if stem.endswith(".png") else None
    return stem if _FRAME_FILE.fullmatch(frame) else None


@dataclass(frozen=True)
class Entry:
    """One case of a manifest: its files (in frame order) with their hashes, and what it was generated from."""

    case_id: str
    files: dict[str, str]
    fingerprint: str | None = None
    fields: dict[str, Any] | None = None
    world_size: int = 1
    pipeline: str | None = None
    shape: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "fields": self.fields,
            "world_size": self.world_size,
            "pipeline": self.pipeline,
            "shape": list(self.shape) if self.shape else None,
            "files": dict(self.files),
        }


@dataclass(frozen=True)
class Reference:
    """A hash-verified reference: its manifest entry and its pixels (``HxWx3`` or ``TxHxWx3`` uint8)."""

    entry: Entry
    array: np.ndarray = field(repr=False)


def pending_set(directory: Path) -> Path | None:
    """:data:`PENDING` when a committed set is in it (its manifest is there), None when there is none; anything at
    that name but a directory parity made (a symlink planted there, a regular file) is a ConfigError, never read."""
    pending = directory / PENDING
    kind = lstat_kind(pending)
    if kind == "nothing":
        return None
    if kind != "a directory":
        raise ConfigError(
            f"is {kind or 'a regular file'}, not a set staged by parity bless (a directory); remove it", path=pending
        )
    return pending if lstat_kind(pending / MANIFEST) is None else None


def manifest_path(directory: Path) -> Path:
    """The manifest in force: the pending one while an interrupted switch-over holds it, else ``manifest.json``."""
    pending = pending_set(directory)
    return directory / MANIFEST if pending is None else pending / MANIFEST


def file_path(directory: Path, name: str) -> Path:
    """Where a file of the set in force is: still in :data:`PENDING` if it has not been moved yet."""
    pending = pending_set(directory)
    return pending / name if pending is not None and lstat_kind(pending / name) != "nothing" else directory / name


def _ordered_files(case_id: str, files: dict[str, Any], path: Path, key: str) -> dict[str, str]:
    """A case's files checked (hex digests; one ``<id>.png`` or frames numbered 0..T-1) and in frame order."""
    for name, digest in files.items():
        if not _SHA256.match(expect_str(digest, path, join_key(key, name))):
            raise ConfigError(f"not a lowercase sha256 hex digest: {digest!r}", path=path, key=join_key(key, name))
    if list(files) == [f"{case_id}.png"]:
        return dict(files)
    expected = [f"{case_id}/frame_{i:04d}.png" for i in range(len(files))]
    for name in expected:
        if name not in files:
            raise ConfigError(
                f"video frames must be numbered 0..T-1; {name} is not listed", path=path, key=key or case_id
            )
    return {name: files[name] for name in expected}


_ENTRY_KEYS = ("fingerprint", "fields", "world_size", "pipeline", "shape", "files")


def _entry(case_id: str, raw: Any, path: Path) -> Entry:
    key = join_key("cases", case_id)
    raw = expect_object(raw, path, key)
    expect_known_keys(raw, _ENTRY_KEYS, path, key)
    files = expect_object(raw.get("files"), path, join_key(key, "files"))
    if not files:
        raise ConfigError("a case needs at least one file", path=path, key=join_key(key, "files"))
    files = _ordered_files(case_id, files, path, join_key(key, "files"))
    digest = raw.get("fingerprint")
    if digest is not None and not _SHA256.match(expect_str(digest, path, join_key(key, "fingerprint"))):
        raise ConfigError("not a sha256 hex digest", path=path, key=join_key(key, "fingerprint"))
    fields = raw.get("fields")
    world = raw.get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"must be a positive integer, got {world!r}", path=path, key=join_key(key, "world_size"))
    shape, pipeline = raw.get("shape"), raw.get("pipeline")
    if shape is not None and not (
        isinstance(shape, list)
        and len(shape) in (3, 4)
        and shape[-1] == 3
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
    ):
        raise ConfigError(
            f"must be [H, W, 3] or [T, H, W, 3] of positive integers, got {shape!r}",
            path=path,
            key=join_key(key, "shape"),
        )
    if pipeline is not None:
        expect_str(pipeline, path, join_key(key, "pipeline"))
    return Entry(
        case_id,
        files,
        digest,
        None if fields is None else expect_object(fields, path, join_key(key, "fields")),
        world,
        pipeline,
        tuple(shape) if shape is not None else None,
    )


class ManifestFormatError(ConfigError):
    """A manifest of another format than this parity's: only a bless of the whole set can replace it."""


def read_manifest(directory: str | Path) -> dict[str, Entry]:
    """``{case id: Entry}`` of the set in force (empty when the directory has none yet)."""
    path = manifest_path(Path(directory))
    if not is_present(path):
        return {}
    doc = expect_object(read_json(path, within=directory), path, "")
    if doc.get("format") != FORMAT:
        raise ManifestFormatError(
            f"unknown manifest format {doc.get('format')!r} (this parity reads {FORMAT}): "
            "`parity bless --all` replaces the whole set",
            path=path,
            key="format",
        )
    expect_known_keys(doc, ("format", "cases"), path, "")
    cases = expect_object(doc.get("cases", {}), path, "cases")
    return {
        expect_id(case_id, path, join_key("cases", case_id)): _entry(case_id, raw, path)
        for case_id, raw in cases.items()
    }


def manifest_json(entries: Mapping[str, Entry]) -> dict[str, Any]:
    """The manifest document of ``entries`` (cases sorted, so a re-bless diffs only what moved)."""
    return {"format": FORMAT, "cases": {case_id: entries[case_id].to_json() for case_id in sorted(entries)}}


def _verified_bytes(directory: Path, name: str, expected: str) -> bytes:
    path = file_path(directory, name)
    if not is_present(path):
        raise ConfigError(f"listed in {MANIFEST} but the file is missing", path=directory / name)
    data = read_regular_bytes(path, within=directory)
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise ConfigError(
            f"sha256 mismatch: {MANIFEST} says {expected}, file is {actual}; re-bless it if the change is intended",
            path=path,
        )
    return data


def find_reference(
    directory: str | Path, case_id: str, manifest: Mapping[str, Entry] | None = None
) -> Reference | None:
    """The verified reference of ``case_id``, or None when the manifest has none (a file on disk that it
    does not list is a ConfigError: it was never blessed). ``manifest``: the set's manifest, already
    read (:func:`read_manifest`), for a caller that looks up many cases."""
    directory = Path(directory)
    check_case_id(case_id)
    entry = (read_manifest(directory) if manifest is None else manifest).get(case_id)
    if entry is None:
        on_disk = [directory / f"{case_id}.png", *sorted((directory / case_id).glob("frame_*.png"))]
        stray = next((p for p in on_disk if p.is_file()), None)
        if stray is not None:
            raise ConfigError(f"file is not in {MANIFEST}: it was never blessed", path=stray)
        return None
    arrays = [decode_rgb_png(_verified_bytes(directory, n, d), directory / n) for n, d in entry.files.items()]
    if list(entry.files) == [f"{case_id}.png"]:
        found = Reference(entry, arrays[0])
    elif len({a.shape for a in arrays}) != 1:
        raise ConfigError(f"frames of video {case_id!r} differ in shape", path=directory / case_id)
    else:
        found = Reference(entry, np.stack(arrays))
    if entry.shape is not None and found.array.shape != entry.shape:
        raise ConfigError(
            f"its pixels are {list(found.array.shape)} but {MANIFEST} records shape {list(entry.shape)}",
            path=directory / next(iter(entry.files)),
        )
    return found


def load_reference(directory: str | Path, case_id: str) -> np.ndarray:
    """The verified reference for ``case_id``: ``HxWx3`` uint8 for an image, ``TxHxWx3`` for a video."""
    found = find_reference(directory, case_id)
    if found is None:
        raise ConfigError(
            f"no reference for case {case_id!r} in {MANIFEST}: run `parity bless {case_id}`",
            path=Path(directory) / MANIFEST,
        )
    return found.array
