"""The hostile inputs: file-level ones for every file kind, and key mutations per kind.

Every entry is a :class:`Hostile`: a name, how to put it in a project, and what must happen: the
loader accepts it (``ACCEPT``) or raises a ConfigError whose message names the file and ``key``
(``key=None``: a file-level refusal, only the file is named). Nothing else may happen: any other
exception is a traceback, and a loader that returns for a refused input wrongly accepts it.
"""

from __future__ import annotations

import copy
import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tests.files.kinds import KINDS, REFERENCE, REFERENCE_PIXELS, Kind, Project, manifest_for, png_bytes

ACCEPT = "accept"
DELETE = object()


@dataclass(frozen=True)
class Hostile:
    kind: str
    name: str
    apply: Callable[[Kind, Project], None]
    expect: str | None  # ACCEPT, or the key a refusal must name (None: the file alone)
    where: str = ""  # the file the refusal names, relative to the project, when not the kind's own

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.name}"


def _text(text: str | bytes) -> Callable[[Kind, Project], None]:
    def apply(kind: Kind, project: Project) -> None:
        data = text.encode("utf-8") if isinstance(text, str) else text
        kind.path(project).write_bytes(data)

    return apply


def _special(what: str) -> Callable[[Kind, Project], None]:
    """Replace the file by something that is not a regular file (or by nothing)."""

    def apply(kind: Kind, project: Project) -> None:
        path = kind.path(project)
        path.unlink()
        if what == "directory":
            path.mkdir()
        elif what == "fifo":
            os.mkfifo(path)
        elif what == "dangling":
            path.symlink_to(path.parent / "does-not-exist")
        elif what in ("/dev/zero", "/dev/null", "/dev/urandom"):
            path.symlink_to(what)
        elif what == "loop":
            path.symlink_to(path.name)
        elif what == "sparse":  # 40 MiB that occupy no disk: over the size cap
            with path.open("wb") as fh:
                fh.truncate(40 * 2**20)
        elif what == "symlink_to_valid":
            real = path.with_name("real_" + path.name + ".src")  # not *.toml: a case directory would load it too
            real.write_text(kind.text())
            path.symlink_to(real.name)

    return apply


def _extra(kind: Kind, raw_value: str) -> str:
    """The kind's valid text with ``_hostile = <raw_value>`` added where unknown keys are tried."""
    if kind.fmt == "json":
        return '{"_hostile": ' + raw_value + ", " + kind.text()[1:]
    return _toml_in_table(kind, raw_value)


def _toml_in_table(kind: Kind, raw_value: str) -> str:
    """Insert ``_hostile = value`` as the first line of the table ``extra_at`` (TOML forbids reopening it)."""
    header = "[" + ".".join(k if k.replace("_", "").isalnum() else json.dumps(k) for k in kind.extra_at) + "]"
    text = kind.text()
    assert header in text, (header, text)
    return text.replace(header + "\n", header + f"\n_hostile = {raw_value}\n", 1)


def _extra_key(kind: Kind) -> str:
    return "_hostile" if kind.fmt == "json" else ".".join([*kind.extra_at, "_hostile"])


def file_level(kind: Kind) -> list[Hostile]:
    """What can be wrong with any file of this kind, whatever its schema."""
    out = [
        Hostile(kind.name, "directory", _special("directory"), None),
        Hostile(kind.name, "fifo", _special("fifo"), None),
        Hostile(kind.name, "dangling_symlink", _special("dangling"), None),
        Hostile(kind.name, "symlink_to_dev_zero", _special("/dev/zero"), None),
        Hostile(kind.name, "symlink_to_dev_null", _special("/dev/null"), None),
        Hostile(kind.name, "symlink_to_dev_urandom", _special("/dev/urandom"), None),
        Hostile(kind.name, "symlink_loop", _special("loop"), None),
        Hostile(kind.name, "sparse_40MiB", _special("sparse"), None),
        Hostile(kind.name, "missing", _special("missing"), ACCEPT if kind.optional else None),
    ]
    if kind.fmt == "png":
        return out
    valid = kind.text()
    empty = ACCEPT if kind.empty_ok else (None if kind.fmt == "json" else "cases")
    key = _extra_key(kind)
    kept = ACCEPT if kind.extra_ok else (kind.extra_refusal or key)
    out += [
        Hostile(kind.name, "symlink_to_valid_file", _special("symlink_to_valid"), ACCEPT if kind.links_ok else None),
        Hostile(kind.name, "empty", _text(""), empty),
        Hostile(kind.name, "whitespace_only", _text("  \n\t\n"), empty),
        Hostile(kind.name, "latin1_byte", _text(valid.encode() + b"\n\xe9"), None),
        Hostile(kind.name, "utf16", _text(valid.encode("utf-16")), None),
        Hostile(kind.name, "utf8_bom", _text(b"\xef\xbb\xbf" + valid.encode()), ACCEPT),
        Hostile(kind.name, "nul_byte", _text(valid + "\x00"), None),
        Hostile(
            kind.name, "truncated", _text(valid[: len(valid) // 2] + ("" if kind.fmt == "json" else '\n"open')), None
        ),
        Hostile(kind.name, "trailing_garbage", _text(valid + ("}}" if kind.fmt == "json" else "\n= =")), None),
        Hostile(
            kind.name,
            "nesting_100k",
            _text("[" * 100_000 + "]" * 100_000 if kind.fmt == "json" else "x = " + "[" * 100_000 + "]" * 100_000),
            None,
        ),
        Hostile(kind.name, "nesting_70", _text(_extra(kind, "[" * 70 + "]" * 70)), key),
        Hostile(kind.name, "nesting_40_kept", _text(_extra(kind, "[" * 40 + "]" * 40)), kept),
        Hostile(kind.name, "int_400_digits", _text(_extra(kind, "9" * 400)), key),
        Hostile(kind.name, "int_5000_digits", _text(_extra(kind, "9" * 5000)), key),
        Hostile(kind.name, "int_2_pow_63", _text(_extra(kind, str(2**63))), key),
        Hostile(kind.name, "int64_max_kept", _text(_extra(kind, str(2**63 - 1))), kept),
        Hostile(kind.name, "float_1e400", _text(_extra(kind, "1e400")), key),
        Hostile(kind.name, "float_5000_digits", _text(_extra(kind, "1" * 5000 + ".0")), key),
        Hostile(kind.name, "long_string_kept", _text(_extra(kind, json.dumps("x" * 2**20))), kept),
    ]
    if kind.fmt == "json":
        first = next(iter(kind.valid))
        out += [
            Hostile(kind.name, "nan", _text(_extra(kind, "NaN")), key),
            Hostile(kind.name, "infinity", _text(_extra(kind, "Infinity")), key),
            Hostile(kind.name, "minus_infinity", _text(_extra(kind, "-Infinity")), key),
            Hostile(kind.name, "duplicate_key", _text("{" + json.dumps(first) + ": null, " + valid[1:]), first),
            Hostile(kind.name, "duplicate_nested_key", _text(_extra(kind, '{"a": 1, "a": 1}')), key + ".a"),
            Hostile(kind.name, "root_array", _text("[]"), None),
            Hostile(kind.name, "root_string", _text('"x"'), None),
            Hostile(kind.name, "root_number", _text("1"), None),
            Hostile(kind.name, "root_null", _text("null"), None),
        ]
    else:
        out += [
            Hostile(kind.name, "nan", _text(_extra(kind, "nan")), key),
            Hostile(kind.name, "plus_inf", _text(_extra(kind, "+inf")), key),
            Hostile(kind.name, "minus_inf", _text(_extra(kind, "-inf")), key),
            Hostile(kind.name, "nan_in_array", _text(_extra(kind, "[1.0, nan]")), key + ".1"),
            Hostile(
                kind.name,
                "duplicate_key",
                _text(_toml_in_table(kind, "1\n_hostile = 2") if kind.extra_at else valid + "\na = 1\na = 2\n"),
                None,
            ),
            Hostile(kind.name, "duplicate_table", _text(valid + "\n" + valid), None),
        ]
    return out


def _mutate(kind: Kind, edits: dict[tuple[str, ...], Any]) -> Callable[[Kind, Project], None]:
    def apply(k: Kind, project: Project) -> None:
        doc = copy.deepcopy(k.valid)
        for path, value in edits.items():
            node = doc
            for part in path[:-1]:
                node = node.setdefault(part, {}) if isinstance(node, dict) else node[int(part)]
            if value is DELETE:
                del node[path[-1]]
            elif isinstance(node, list):
                node[int(path[-1])] = value
            else:
                node[path[-1]] = value
        k.write(project, doc)

    return apply


def mutations(kind: str, table: list[tuple[Any, ...]]) -> list[Hostile]:
    """``(name, {key path: value or DELETE}, expect[, where])`` rows as hostile inputs of ``kind``."""
    return [Hostile(kind, name, _mutate(KINDS[kind], edits), expect, *rest) for name, edits, expect, *rest in table]


def _png(name: str, data: bytes, expect: str | None, rehash: bool = True) -> Hostile:
    """A PNG kind case; with ``rehash`` the manifest is updated so the decoder itself is tested."""

    def apply(kind: Kind, project: Project) -> None:
        kind.path(project).write_bytes(data)
        if rehash:
            KINDS["manifest"].write(project, manifest_for(data))

    return Hostile("png", name, apply, expect)


def _with_header(width: int, height: int) -> bytes:
    """The valid PNG with its IHDR claiming another size (a decompression bomb's header)."""
    return REFERENCE[:16] + width.to_bytes(4, "big") + height.to_bytes(4, "big") + REFERENCE[24:]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def apng_bytes(frame: np.ndarray, frames: int) -> bytes:
    """An animated PNG of ``frames`` copies of the RGB ``frame``, written chunk by chunk: one compressed image
    shared by every frame, so 100 black frames of 2048 x 2048 are a 1.2 MB file that decodes to 1.2 GB."""
    height, width, _ = frame.shape
    pixels = zlib.compress(b"".join(b"\x00" + row.tobytes() for row in np.ascontiguousarray(frame, np.uint8)), 9)
    out = [
        b"\x89PNG\r\n\x1a\n",
        _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)),
        _chunk(b"acTL", struct.pack(">II", frames, 0)),
    ]
    sequence = 0
    for index in range(frames):
        out.append(_chunk(b"fcTL", struct.pack(">IIIIIHHBB", sequence, width, height, 0, 0, 1, 10, 0, 0)))
        sequence += 1
        if index == 0:
            out.append(_chunk(b"IDAT", pixels))
        else:
            out.append(_chunk(b"fdAT", struct.pack(">I", sequence) + pixels))
            sequence += 1
    return b"".join([*out, _chunk(b"IEND", b"")])


def png_cases() -> list[Hostile]:
    rgb = np.zeros((4, 4, 3), dtype=np.uint8)
    return [
        _png("valid_other_image", png_bytes(rgb + 7), ACCEPT),
        _png("rgba", png_bytes(np.zeros((4, 4, 4), dtype=np.uint8)), None),
        _png("grayscale", png_bytes(np.zeros((4, 4), dtype=np.uint8)), None),
        _png("sixteen_bit_gray", png_bytes(np.zeros((4, 4), dtype=np.uint16)), None),
        _png("truncated", REFERENCE[: len(REFERENCE) // 2], None),
        _png("not_a_png", b"GIF89a" + bytes(100), None),
        _png("empty", b"", None),
        _png("bomb_header_100000x100000", _with_header(100_000, 100_000), None),
        _png("header_2_pow_32_minus_1", _with_header(2**32 - 1, 1), None),
        _png("hash_mismatch", png_bytes(rgb), None, rehash=False),
        _png("apng_whose_first_frame_is_the_reference", apng_bytes(REFERENCE_PIXELS, 2), None),
        _png("apng_100_frames_of_2048x2048", apng_bytes(np.zeros((2048, 2048, 3), np.uint8), 100), None),
    ]
