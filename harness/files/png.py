"""8-bit RGB PNGs: the one encoder and the one guarded decoder (references, candidates, a command's output).

Decoding checks the signature and the IHDR header first and refuses a picture that declares more
than :data:`MAX_PIXELS` pixels before imageio allocates them (a small file can declare a huge image).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.errors import ConfigError

#: Pixels a PNG may declare (8192 x 8192): checked in its header, before decoding allocates them.
MAX_PIXELS = 2**26
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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
    try:
        array = np.asarray(iio.imread(data, extension=".png"))
    except Exception as exc:  # noqa: BLE001 - imageio raises plugin-specific errors for corrupt data
        raise ConfigError(f"cannot decode PNG: {exc}", path=path) from None
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise ConfigError(f"must be 8-bit RGB, got dtype {array.dtype} shape {array.shape}", path=path)
    return array
