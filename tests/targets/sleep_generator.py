"""A generator whose time is sleep, not compute: what a served pipeline looks like from its client (``command`` target).

Each denoising step sleeps ``--step-ms`` times ``1 + --slow`` (``--slow 0.1``: every step 10 %
slower, the planted slowdown of the perf tests), text encoding and decoding ``--stage-ms`` each;
it writes one flat PNG into ``--out`` and, with ``--timings``, what it measured in parity's
schema. Standard library only, so the interpreter's start (part of parity's wall clock of the
command) stays short.
"""

from __future__ import annotations

import argparse
import json
import shlex
import struct
import sys
import time
import zlib
from pathlib import Path

FIELDS = {"height": 16, "width": 16, "steps": 4, "step_ms": 10}  # a case of 4 steps of 10 ms


def template(*python_flags: str) -> str:
    """Its ``command`` template (the case's fields: :data:`FIELDS`), run by this interpreter with ``python_flags``
    (``-S -E`` start it in a quarter of the time: no site packages, which it does not need)."""
    return (
        shlex.join([sys.executable, *python_flags, str(Path(__file__).resolve())])
        + " --out {out_dir} --height {height} --width {width} --steps {steps} --step-ms {step_ms} --timings {timings}"
    )


def png(height: int, width: int, rgb: tuple[int, int, int]) -> bytes:
    """A flat 8-bit RGB PNG."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def timed_sleep(ms: float) -> float:
    start = time.perf_counter()
    time.sleep(ms / 1000.0)
    return (time.perf_counter() - start) * 1000.0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--height", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--step-ms", type=float, required=True)
    parser.add_argument("--stage-ms", type=float, default=2.0)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--timings", type=Path, default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    text = timed_sleep(args.stage_ms)
    steps = [timed_sleep(args.step_ms * (1.0 + args.slow)) for _ in range(args.steps)]
    decode = timed_sleep(args.stage_ms)
    (args.out / "image.png").write_bytes(png(args.height, args.width, (90, 120, 200)))
    e2e = (time.perf_counter() - start) * 1000.0
    if args.timings:
        args.timings.write_text(
            json.dumps(
                {
                    "e2e_ms": e2e,
                    "denoise_step_ms": steps,
                    "stages_ms": {"TextEncodingStage": text, "DenoisingStage": sum(steps), "DecodingStage": decode},
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
