"""Atomic file writes for baselines, manifests and results.

A CI job killed mid-write (timeout, OOM killer, SIGKILL) must never leave a half-written
baseline behind: the next run would either crash on it or, worse, gate against garbage. Every
write therefore goes to a temporary file in the target's own directory (same filesystem, so the
final ``os.replace`` is an atomic rename), is fsynced, and only then replaces the target. A reader
sees the old complete file or the new complete file, nothing in between.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable

__all__ = ["write_bytes_atomic", "write_json_atomic", "dump_json"]


def dump_json(obj: Any) -> str:
    """Serialise like sglang's own writer (``json.dump(indent=4)``), so rewriting an unchanged
    sglang file is byte-identical and a recalibration diff shows only the values that moved.

    ``allow_nan=False``: NaN/Infinity are not JSON; refusing them here keeps every file we write
    readable by strict parsers (callers encode an infinite PSNR explicitly, see harness.metrics).
    """
    return json.dumps(obj, indent=4, allow_nan=False)


def _fsync_dir(directory: Path) -> None:
    """Persist the rename itself; without it a power loss can resurrect the old directory entry."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms (Windows) where a directory cannot be opened: rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _open_temp(target: Path) -> tuple[int, Path]:
    """Create a fresh sibling temp file with mode 0666 & ~umask, like a plain ``open(.., "w")``.

    (mkstemp would create it 0600, and after the rename a baseline would become unreadable to the
    rest of a shared CI machine.) An existing target keeps its own mode.
    """
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            continue
        try:
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        except FileNotFoundError:
            pass
        return fd, tmp


def _replace_from_temp(target: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through ``write(fileobj)`` into a sibling temp file, fsync it, rename it over target."""
    fd, tmp = _open_temp(target)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | Path, data: bytes, backup: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically; with ``backup`` the previous file is kept as
    ``path.bak`` (itself written atomically, so a crash cannot leave a torn backup either)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if backup and target.exists():
        bak = target.with_name(target.name + ".bak")
        with target.open("rb") as src:
            _replace_from_temp(bak, lambda fh: shutil.copyfileobj(src, fh))
    _replace_from_temp(target, lambda fh: fh.write(data))
    _fsync_dir(target.parent)


def write_json_atomic(path: str | Path, obj: Any, backup: bool = False) -> None:
    """Serialise ``obj`` with :func:`dump_json` and write it with :func:`write_bytes_atomic`.

    Serialisation happens before the temp file is created, so an unserialisable object (or a NaN)
    raises without touching the disk.
    """
    write_bytes_atomic(path, dump_json(obj).encode("utf-8"), backup=backup)
