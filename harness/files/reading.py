"""Opening an input file so that no input can hang parity, exhaust its memory or end in a traceback.

A FIFO blocks ``open`` forever, a symlink to /dev/zero reads until memory runs out, a directory or a
non-UTF-8 file raises without naming the input. So every reader goes through :func:`read_text` (or
:func:`read_regular_bytes`): regular files only (symlinks followed), at most ``max_bytes``, UTF-8,
every refusal a ConfigError naming the file. :func:`is_present` checks optional files: nothing
there is a normal answer, anything there that is not a regular file an error (a dangling overlay
symlink must not mean "no overlay"). A file handed over from outside (a command's output, a results
directory's candidates) is read ``within`` its directory with ``O_NOFOLLOW`` at every component, so
a link to the blessed reference is refused.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from harness.errors import ConfigError

__all__ = [
    "MAX_BYTES",
    "describe_non_regular",
    "is_present",
    "is_directory_present",
    "read_regular_bytes",
    "read_text",
    "lstat_kind",
]

#: The largest file parity reads (results and sweep files of big runs are a few MB).
MAX_BYTES = 32 * 2**20

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def describe_non_regular(path: str | Path) -> str | None:
    """What is at ``path`` when it is not a regular file ("a directory", "a dangling symlink to 'x'",
    "nothing"), or None for a regular file (after following symlinks)."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        if os.path.islink(p):
            return f"a dangling symlink to {os.readlink(p)!r}"
        return "nothing"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop"
        raise ConfigError(f"cannot read: {exc.strerror}", path=p) from None
    except ValueError as exc:  # an embedded NUL byte
        raise ConfigError(f"not a usable path: {exc}", path=repr(str(p))) from None
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def is_present(path: str | Path) -> bool:
    """True for a regular file, False when nothing is at ``path``; a ConfigError for anything else."""
    kind = describe_non_regular(path)
    if kind == "nothing":
        return False
    if kind is not None:
        raise ConfigError(f"exists but is {kind}, not a regular file", path=path)
    return True


def is_directory_present(path: str | Path) -> bool:
    """True for a directory, False when nothing is at ``path``; a ConfigError for anything else (a file,
    a FIFO or a dangling symlink where a directory of cases belongs must not mean "no cases")."""
    kind = describe_non_regular(path)
    if kind == "a directory":
        return True
    if kind == "nothing":
        return False
    raise ConfigError(f"exists but is {kind or 'a regular file'}, not a directory", path=path)


_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def lstat_kind(path: str | Path) -> str | None:
    """What is at ``path`` itself, a symlink not followed: None for a regular file, else "nothing",
    "a symlink to 'x'", "a directory", "a FIFO (named pipe)", ..."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "nothing"
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", path=path) from None
    except ValueError as exc:  # an embedded NUL byte
        raise ConfigError(f"not a usable path: {exc}", path=repr(str(path))) from None
    if stat.S_ISLNK(mode):
        return f"a symlink to {os.readlink(path)!r}"
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _open_within(path: Path, root: Path) -> int:
    """A descriptor of ``path`` opened one component at a time from ``root``, following no symlink."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    parts = Path(rel).parts
    if not parts or parts[0] == os.pardir or rel == os.curdir:
        raise ConfigError(f"is not a file inside {root}", path=path)
    here = root
    try:
        fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", path=root) from None
    try:
        for i, part in enumerate(parts):
            here = here / part
            last = i == len(parts) - 1
            kind = lstat_kind(here)
            if kind == "nothing":
                raise ConfigError("file not found", path=here)
            if kind is not None and not (kind == "a directory" and not last):
                raise ConfigError(f"is {kind}; parity reads only regular files that {root} itself holds", path=here)
            flags = (_READ_FLAGS if last else os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)) | _NOFOLLOW
            try:
                child = os.open(part, flags, dir_fd=fd)
            except OSError as exc:  # swapped for a symlink (ELOOP) or a non-directory (ENOTDIR) since the check
                raise ConfigError(f"cannot read: {exc.strerror}", path=here) from None
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | Path, max_bytes: int = MAX_BYTES, within: str | Path | None = None) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``; a ConfigError naming the file otherwise.

    The kind is checked before opening (opening a device can have side effects) and again on the
    open descriptor (the path may have been swapped in between); O_NONBLOCK keeps a FIFO that
    slipped in from blocking the open. With ``within`` the file must lie in that directory and be
    reached without any symlink (see the module docstring).
    """
    p = Path(path)
    if within is not None:
        fd = _open_within(p, Path(within))
    else:
        kind = describe_non_regular(p)
        if kind == "nothing":
            raise ConfigError("file not found", path=p)
        if kind is not None:
            raise ConfigError(f"is {kind}, not a regular file", path=p)
        try:
            fd = os.open(p, _READ_FLAGS)
        except OSError as exc:
            raise ConfigError(f"cannot read: {exc.strerror}", path=p) from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError("is not a regular file (it changed while being opened)", path=p)
        if info.st_size > max_bytes:
            raise ConfigError(f"is {info.st_size} bytes; the limit is {max_bytes}", path=p)
        try:
            data = fh.read(max_bytes + 1)  # st_size can lie (/proc files say 0): never read more than the limit
        except OSError as exc:
            raise ConfigError(f"cannot read: {exc.strerror}", path=p) from None
    if len(data) > max_bytes:
        raise ConfigError(f"is larger than the limit of {max_bytes} bytes", path=p)
    return data


def read_text(path: str | Path, max_bytes: int = MAX_BYTES, within: str | Path | None = None) -> str:
    """A regular file's text, which must be UTF-8 (a leading byte-order mark is dropped); ``within`` as for
    :func:`read_regular_bytes`."""
    data = read_regular_bytes(path, max_bytes, within)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} (line {line})", path=path
        ) from None
    return text.removeprefix("\ufeff")
