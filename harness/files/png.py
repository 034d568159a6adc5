"""8-bit RGB PNGs: the one encoder and the one guarded decoder (references, candidates, a command's output).

Decoding checks the signature and the IHDR header first and refuses a picture that declares more
than :data:`MAX_PIXELS` pixels before imageio allocates them (a small file can declare a huge image),
then walks the chunks and refuses an animated PNG (``acTL``/``fcTL``): a 0.6 MB APNG of many frames,
each within the pixel limit, decodes to gigabytes frame by frame. Only the first image is decoded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.errors import ConfigError

#: Pixels a PNG may declare (8192 x 8192): checked in its header, before decoding allocates them.
MAX_PIXELS = 2**26
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_ANIMATION_CHUNKS = (b"acTL", b"fcTL", b"fdAT")


def encode_png(array: np.ndarray) -> bytes:
    """``array`` (uint8 HxWx3) as PNG bytes."""
    import imageio.v3 as iio

    return bytes(iio.imwrite("<bytes>", np.ascontiguousarray(array), extension=".png"))


def decode_rgb_png(data: bytes, path: str | Path) -> np.ndarray:
    """The uint8 ``HxWx3`` pixels of PNG ``data`` read from ``path``; a ConfigError naming ``path`` otherwise."""
    import imageio.v3 as iio

    if data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ConfigError("not a PNG file (no PNG signature and IHDR header)", path=path)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if width * height > MAX_PIXELS:
        raise ConfigError(f"declares {width}x{height} pixels; the limit is {MAX_PIXELS}", path=path)
    _refuse_animation(data, path)
    try:
        array = np.asarray(iio.imread(data, extension=".png", index=0))
    except Exception as exc:  # noqa: BLE001 - imageio raises plugin-specific errors for corrupt data
        raise ConfigError(f"cannot decode PNG: {exc}", path=path) from None
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise ConfigError(f"must be 8-bit RGB, got dtype {array.dtype} shape {array.shape}", path=path)
    return array


def _refuse_animation(data: bytes, path: str | Path) -> None:
    """Walk the chunk headers (length, type) without decoding anything; an APNG's frame chunks are refused."""
    offset = len(_PNG_SIGNATURE)
    while offset + 8 <= len(data):
        length, kind = int.from_bytes(data[offset : offset + 4], "big"), data[offset + 4 : offset + 8]
        if kind in _ANIMATION_CHUNKS:
            frames = int.from_bytes(data[offset + 8 : offset + 12], "big") if kind == b"acTL" else None
            count = f", {frames} frames" if frames is not None else ""
            raise ConfigError(
                f"an animated PNG (APNG{count}): a reference or candidate file is one still image "
                "(a video is one PNG per frame)",
                path=path,
            )
        if kind == b"IEND":
            return
        offset += 12 + length  # length, type, data, CRC
