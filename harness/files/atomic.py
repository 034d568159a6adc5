"""Atomic file writes for baselines, manifests and results.

A CI job killed mid-write must never leave a half-written baseline. Every write goes to a temporary
file in the target's own directory (so ``os.replace`` is an atomic rename), is fsynced, then
replaces the target: a reader sees the old file or the new one. A writer killed before the rename
leaves ``.<name>.<12 hex>.tmp``; the next write into that directory removes it once orphaned. The
writer holds an exclusive ``flock`` on its temp file until after the rename (the kernel drops it
when the process dies), so an unlocked temp file older than :data:`ORPHAN_GRACE_S` belongs to
nobody; without locks, only temp files older than :data:`STALE_TEMP_S` are removed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from harness.errors import ConfigError

try:
    import fcntl
except ImportError:  # Windows: no flock; stale temp files are then recognised by age alone
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "write_bytes_atomic",
    "write_json_atomic",
    "dump_json",
    "check_writable",
    "remove_orphaned_temps",
    "ORPHAN_GRACE_S",
    "STALE_TEMP_S",
]

ORPHAN_GRACE_S = 30.0
STALE_TEMP_S = 3600.0
_TEMP_NAME = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")


def dump_json(obj: Any) -> str:
    """Serialise like sglang's own writer (``json.dump(indent=4)``), so rewriting an unchanged
    sglang file is byte-identical and a recalibration diff shows only the values that moved.

    ``allow_nan=False``: NaN/Infinity are not JSON; refusing them here keeps every file we write
    readable by strict parsers (callers encode an infinite PSNR explicitly, see harness.metrics).
    """
    return json.dumps(obj, indent=4, allow_nan=False)


def fsync_dir(directory: Path) -> None:
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


def _lock(fd: int, blocking: bool = True) -> bool | None:
    """Take an exclusive flock: True when taken, False when another process holds it, None where
    locks are not supported (no fcntl, or a filesystem without locks)."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _open_temp(target: Path) -> tuple[int, Path]:
    """Create and lock a fresh sibling temp file with mode 0666 & ~umask, like a plain ``open(.., "w")``.

    (mkstemp would create it 0600, and after the rename a baseline would become unreadable to the
    rest of a shared CI machine.) An existing target keeps its own mode.
    """
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            continue
        _lock(fd)
        try:
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        except FileNotFoundError:
            pass
        return fd, tmp


def _replace_from_temp(target: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through ``write(fileobj)`` into a sibling temp file, fsync it, rename it over target.

    The rename happens while the temp file is still open and locked (POSIX), so a cleaner never
    takes it for an orphan; Windows cannot rename an open file and has no flock anyway.
    """
    fd, tmp = _open_temp(target)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
            if fcntl is not None:
                os.replace(tmp, target)
        if fcntl is None:
            os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _is_orphan(path: Path, now: float) -> bool:
    """Whether ``path`` is a temp file no live writer holds (see the module docstring)."""
    try:
        age = now - path.lstat().st_mtime
        if age < ORPHAN_GRACE_S:
            return False
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        taken = _lock(fd, blocking=False)
    finally:
        os.close(fd)  # closing drops a lock taken here; a writer that locks later has a new file anyway
    return taken is True or (taken is None and age >= STALE_TEMP_S)


def remove_orphaned_temps(directory: str | Path) -> list[Path]:
    """Remove the temp files of killed writers in ``directory``; best effort, returns what was removed."""
    removed = []
    now = time.time()
    try:
        entries = [
            Path(e.path)
            for e in os.scandir(directory)
            if _TEMP_NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False)
        ]
    except OSError:
        return removed
    for path in entries:
        if _is_orphan(path, now):
            try:
                path.unlink()
            except OSError:
                continue
            removed.append(path)
    return removed


def check_writable(path: str | Path, key: str, directory: bool = False) -> None:
    """Refuse, before any work, an output that cannot be written: ``path`` (a file, or with
    ``directory`` a directory to write into) must be creatable and writable. Creates missing
    directories (the write would) and probes with a temp file that is removed at once."""
    target = Path(path)
    folder = target if directory else target.parent
    if not directory and target.is_dir():
        raise ConfigError("is a directory; give a file name", path=target, key=key)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = _open_temp(folder / (".probe" if directory else target.name))
        os.close(fd)
        tmp.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write here: {exc.strerror or exc}", path=target, key=key) from None


def write_bytes_atomic(path: str | Path, data: bytes, backup: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically; with ``backup`` the previous file is kept as
    ``path.bak`` (itself written atomically, so a crash cannot leave a torn backup either)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_orphaned_temps(target.parent)
    if backup and target.exists():
        bak = target.with_name(target.name + ".bak")
        with target.open("rb") as src:
            _replace_from_temp(bak, lambda fh: shutil.copyfileobj(src, fh))
    _replace_from_temp(target, lambda fh: fh.write(data))
    fsync_dir(target.parent)


def write_json_atomic(path: str | Path, obj: Any, backup: bool = False) -> None:
    """Serialise ``obj`` with :func:`dump_json` and write it with :func:`write_bytes_atomic`.

    Serialisation happens before the temp file is created, so an unserialisable object (or a NaN)
    raises without touching the disk.
    """
    write_bytes_atomic(path, dump_json(obj).encode("utf-8"), backup=backup)
