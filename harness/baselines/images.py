"""Reference images and videos, pinned by a manifest of SHA-256 hashes.

Layout of a reference directory::

    refs/
      manifest.json                  {"<relative file>": "<sha256 hex>", ...}
      flux_image_t2i.png             an image case: one RGB PNG
      wan_t2v/frame_0000.png         a video case: one RGB PNG per frame, frame_<index>.png
      wan_t2v/frame_0001.png

Per-frame PNGs (rather than one strip) because each frame is then hashed on its own, a diff of
a re-blessed video shows which frames moved, and the frame count needs no extra metadata.

A reference is only trusted if its bytes hash to the manifest entry: a mismatch, a file missing
from the manifest, or a manifest entry whose file is missing is a ConfigError naming the file. A
gate must never compare against a reference nobody blessed. Hash and decode read the same bytes,
so what is verified is exactly what is compared.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from harness.files.atomic import write_bytes_atomic, write_json_atomic
from harness.files.jsonio import expect_id, expect_object, expect_str, read_json
from harness.files.reading import is_present, read_regular_bytes
from harness.errors import ConfigError

__all__ = ["MANIFEST", "REFERENCES_DIR", "MAX_PIXELS", "load_reference", "bless", "read_manifest"]

MANIFEST = "manifest.json"
REFERENCES_DIR = "images"  # <baselines>/images: reference PNGs and their manifest
#: Pixels a reference PNG may declare (8192 x 8192): checked in its header, before decoding allocates them.
MAX_PIXELS = 2**26
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _frame_name(case_id: str, index: int) -> str:
    return f"{case_id}/frame_{index:04d}.png"


def read_manifest(directory: str | Path) -> dict[str, str]:
    """The ``{file: sha256}`` manifest (empty when the directory has none yet)."""
    path = Path(directory) / MANIFEST
    if not is_present(path):
        return {}
    manifest = expect_object(read_json(path), path, "")
    for name, digest in manifest.items():
        if not _SHA256.match(expect_str(digest, path, name)):
            raise ConfigError(f"not a lowercase sha256 hex digest: {digest!r}", path=path, key=name)
    return manifest


def _case_files(manifest: dict[str, str], case_id: str) -> list[str]:
    """Manifest entries of a case: ``<id>.png`` or the ``<id>/frame_*.png`` sequence, in order."""
    if f"{case_id}.png" in manifest:
        return [f"{case_id}.png"]
    pattern = re.compile(rf"{re.escape(case_id)}/frame_(\d+)\.png")
    frames = {int(m.group(1)): name for name in manifest if (m := pattern.fullmatch(name))}
    return [frames[i] for i in sorted(frames)]  # numeric order: frame_10000 after frame_9999


def _decode_png(data: bytes, path: Path) -> np.ndarray:
    import imageio.v3 as iio

    if data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ConfigError("not a PNG file (no PNG signature and IHDR header)", path=path)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if width * height > MAX_PIXELS:
        raise ConfigError(f"declares {width}x{height} pixels; the limit is {MAX_PIXELS}", path=path)
    try:
        array = np.asarray(iio.imread(data, extension=".png"))
    except Exception as exc:  # imageio raises plugin-specific errors for corrupt data
        raise ConfigError(f"cannot decode PNG: {exc}", path=path) from None
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise ConfigError(f"reference must be 8-bit RGB, got dtype {array.dtype} shape {array.shape}", path=path)
    return array


def _encode_png(array: np.ndarray) -> bytes:
    import imageio.v3 as iio

    return bytes(iio.imwrite("<bytes>", array, extension=".png"))


def _verified_bytes(directory: Path, name: str, expected: str) -> bytes:
    path = directory / name
    if not is_present(path):
        raise ConfigError(f"listed in {MANIFEST} but the file is missing", path=path)
    data = read_regular_bytes(path)
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise ConfigError(
            f"sha256 mismatch: {MANIFEST} says {expected}, file is {actual}; re-bless it if the change is intended",
            path=path,
        )
    return data


def load_reference(directory: str | Path, case_id: str) -> np.ndarray:
    """The verified reference for ``case_id``: ``HxWx3`` uint8 for an image, ``TxHxWx3`` for a video."""
    directory = Path(directory)
    expect_id(case_id, None, "case_id")
    manifest = read_manifest(directory)
    names = _case_files(manifest, case_id)
    if not names:
        on_disk = [directory / f"{case_id}.png", *sorted((directory / case_id).glob("frame_*.png"))]
        stray = next((p for p in on_disk if p.is_file()), None)
        if stray is not None:
            raise ConfigError(f"file is not in {MANIFEST}: it was never blessed", path=stray)
        raise ConfigError(f"no reference for case {case_id!r} in {MANIFEST}", path=directory / MANIFEST)
    for index, name in enumerate(names):
        expected = _frame_name(case_id, index)
        if name != f"{case_id}.png" and name != expected:
            raise ConfigError(f"video frames must be numbered 0..T-1; {expected} is not listed", path=directory / MANIFEST)
    arrays = [_decode_png(_verified_bytes(directory, n, manifest[n]), directory / n) for n in names]
    if len(names) == 1 and names[0] == f"{case_id}.png":
        return arrays[0]
    if len({a.shape for a in arrays}) != 1:
        raise ConfigError(f"frames of video {case_id!r} differ in shape", path=directory / case_id)
    return np.stack(arrays)


def bless(directory: str | Path, case_id: str, array: Any) -> list[str]:
    """Store ``array`` (``HxWx3`` image or ``TxHxWx3`` video, uint8) as the reference for
    ``case_id`` and record its hashes; returns the files written (relative to ``directory``).

    PNGs are written first and the manifest last, each atomically: a crash in between leaves a
    PNG whose hash does not match, which fails loudly on load instead of passing silently.
    Files of the case's previous reference that the new one does not reuse are removed.
    """
    directory = Path(directory)
    expect_id(case_id, None, "case_id")
    array = np.asarray(array)
    if array.dtype != np.uint8 or array.ndim not in (3, 4) or array.shape[-1] != 3 or 0 in array.shape:
        raise ValueError(f"bless needs uint8 HxWx3 or TxHxWx3, got dtype {array.dtype} shape {array.shape}")
    manifest = read_manifest(directory)
    old = set(_case_files(manifest, case_id))
    if array.ndim == 3:
        items = {f"{case_id}.png": array}
    else:
        items = {_frame_name(case_id, i): frame for i, frame in enumerate(array)}
    for name, image in items.items():
        data = _encode_png(np.ascontiguousarray(image))
        write_bytes_atomic(directory / name, data)
        manifest[name] = hashlib.sha256(data).hexdigest()
    for name in old - set(items):
        del manifest[name]
    write_json_atomic(directory / MANIFEST, dict(sorted(manifest.items())))
    for name in old - set(items):
        (directory / name).unlink(missing_ok=True)
    return list(items)
