"""A stand-in for an external generator (``sglang generate ...``) that the ``command`` pipeline target runs.

It writes a seeded, prompt-dependent smooth RGB image (or frames) as PNGs into ``--out``, and
optionally a timings JSON in parity's or sglang's schema. Its knobs are the faults a gate must
catch: ``--sp-bug`` perturbs one quadrant by 40 levels when asked for more than one rank (a planted
multi-rank attention error; one rank stays right), ``--seed-offset`` draws from another seed,
``--fail`` exits 3 with a message on stderr, ``--sleep`` outlives a timeout (in a child process, so
the target's kill of the whole session is tested too). ``--log`` appends every invocation's
arguments as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import zlib
from pathlib import Path

import imageio.v3 as iio
import numpy as np


def image(prompt: str, seed: int, height: int, width: int, frame: int = 0) -> np.ndarray:
    """A 4x4 random grid (from seed and prompt) upsampled to height x width, plus a gradient: smooth, not flat."""
    rng = np.random.default_rng([seed, zlib.crc32(prompt.encode()), frame])
    grid = rng.uniform(40, 215, size=(4, 4, 3))
    rows = np.linspace(0, 3, height)[:, None]
    cols = np.linspace(0, 3, width)[None, :]
    r0, c0 = np.floor(rows).astype(int).clip(0, 2), np.floor(cols).astype(int).clip(0, 2)
    fr, fc = (rows - r0)[..., None], (cols - c0)[..., None]
    smooth = (
        grid[r0, c0] * (1 - fr) * (1 - fc)
        + grid[r0 + 1, c0] * fr * (1 - fc)
        + grid[r0, c0 + 1] * (1 - fr) * fc
        + grid[r0 + 1, c0 + 1] * fr * fc
    )
    return np.clip(smooth + np.linspace(-20, 20, width)[None, :, None], 0, 255).round().astype(np.uint8)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--height", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--frames", type=int, default=0)
    parser.add_argument("--timings", type=Path, default=None)
    parser.add_argument("--schema", choices=("parity", "sglang"), default="parity")
    parser.add_argument("--sp-bug", action="store_true")
    parser.add_argument("--seed-offset", type=int, default=0)
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--log", type=Path, default=None)
    args = parser.parse_args()
    if args.log:
        with args.log.open("a") as log:
            log.write(json.dumps({"argv": sys.argv[1:], "world_size": args.world_size}) + "\n")
    if args.fail:
        print("loading weights...\nRuntimeError: CUDA out of memory (planted)", file=sys.stderr)
        return 3
    if args.sleep:  # a child that would outlive its parent if only the parent were killed
        sleeper = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({args.sleep})"])
        (args.out / "sleeper.pid").write_text(str(sleeper.pid))
        sleeper.wait()
    start = time.perf_counter()
    frames = [
        image(args.prompt, args.seed + args.seed_offset, args.height, args.width, i) for i in range(max(args.frames, 1))
    ]
    if args.sp_bug and args.world_size > 1:
        for frame in frames:
            frame[: args.height // 2, : args.width // 2] = np.clip(
                frame[: args.height // 2, : args.width // 2] + 40, 0, 255
            )
    if args.frames:
        (args.out / "frames").mkdir()
        for i, frame in enumerate(frames):
            iio.imwrite(args.out / "frames" / f"{i}.png", frame)  # 0.png, 1.png, ...: read back in numeric order
    else:
        iio.imwrite(args.out / "image.png", frames[0])
    e2e = (time.perf_counter() - start) * 1000 + 3.0
    if args.timings:
        if args.schema == "parity":
            doc = {
                "e2e_ms": e2e,
                "stages_ms": {"TextEncodingStage": 1.0, "DenoisingStage": 1.5, "DecodingStage": 0.5},
                "denoise_step_ms": [0.75, 0.75],
            }
        else:
            doc = {
                "total_duration_ms": e2e,
                "steps": [{"name": "DenoisingStage", "duration_ms": 1.5}],
                "denoise_steps_ms": [{"step": 0, "duration_ms": 0.75}, {"step": 1, "duration_ms": 0.75}],
                "commit_hash": "abc123",
            }
        args.timings.write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
