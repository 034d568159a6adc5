"""``parity init``: a working project in a repository of one's own, so every write lands there.

It writes the project file, an example contract case and image case (both on parity's built-in
reference target and tiny pipeline, so the first gate runs before anything is configured) and
empty baselines in sglang's schemas: thresholds with parity's default bounds and no case yet, perf
baselines with parity's tolerance profiles and no scenario. A file that exists already is never
overwritten: the whole init is refused, naming every one.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines.perf import PERF_BASE_FILE, PerfBaselines
from harness.baselines.thresholds import THRESHOLDS_FILE, ThresholdSet
from harness.errors import ConfigError
from harness.files.atomic import dump_json, write_bytes_atomic
from harness.files.jsonio import read_json
from harness.paths import default_baselines_dir, is_inside_package, parity_home
from harness.project.config import PROJECT_FILE

CASES = "parity/cases"
BASELINES = "parity/baselines"
REPORT = "parity-report"

PROJECT_TEXT = f"""\
# parity's project file: every parity verb run in this directory or below reads it, and a
# command-line option overrides its key (`parity doctor` says which file is in use).
cases = "{CASES}"          # contracts/*.toml (attention contract cases), images/*.toml (image cases)
baselines = "{BASELINES}"  # thresholds, perf baselines and reference images: every write goes here

# The attention implementation the contract cases judge (default: parity's reference):
# target = "mypkg.attention:factory"
# target_args = {{ layer = "mypkg.layers:USPAttention" }}
# What the image cases run (default: parity's tiny reference pipeline), e.g. your own generator:
# pipeline_target = "command"
# pipeline_target_args = {{ template = "python gen.py --prompt {{prompt}} --seed {{seed}} --out {{out_dir}}" }}
# device = "cpu"          # or "cuda"
# profile = "pr_test"     # perf tolerance profile of the stored perf baselines (or "long_term")
"""

CONTRACT_TEXT = """\
# Contract cases: each runs one contract of `parity list` on the target, here Ulysses sequence
# parallelism on 2 ranks against one rank (bitwise) and a float64 oracle (the FlashAttention rule).
[cases.example_ulysses]
contract = "usp.ulysses_parity"
world_size = 2
dtype = "bf16"
causal = true
"""

IMAGE_TEXT = """\
# Image cases: each runs the pipeline target with these fields on `world_size` ranks and compares
# the output with its one-rank reference (`parity bless` writes it into the baselines). The fields
# are the pipeline target's: these are parity's tiny reference pipeline's. Without a CLIP model
# (--clip-model DIR or PARITY_CLIP_MODEL) the clip bound is not measured: `unmeasured` pins that skip
# (drop it once CI has a model; an unpinned unmeasured bound fails its case).
[defaults]
unmeasured = { clip = "no CLIP model configured" }
weights = "tiny-v1"
prompt = "a cameraman"
seed = 0
height = 32
width = 32
steps = 4

[cases.example_1rank]
description = "one rank: a regression check against the blessed image"
world_size = 1

[cases.example_2ranks]
description = "Ulysses SP=2: must reproduce the one-rank image"
world_size = 2
"""


@dataclass(frozen=True)
class Skeleton:
    """What ``parity init`` wrote, and the commands to run next (from the project's directory)."""

    root: Path
    files: tuple[Path, ...]
    next_commands: tuple[str, ...]


def _thresholds() -> dict[str, Any]:
    """parity's own default bounds (``default_*``), no case: a case without its own entry gets them."""
    own = read_json(default_baselines_dir() / THRESHOLDS_FILE)
    doc = {
        "_comment": "Image thresholds in sglang's consistency_threshold.json schema: default_* for every case, "
        "cases.<id> to override one; `parity recalibrate thresholds` proposes values from gate results."
    }
    doc.update({k: v for k, v in own.items() if k.startswith("default_")})
    doc["cases"] = {}
    ThresholdSet.from_json(doc, THRESHOLDS_FILE)
    return doc


def _perf() -> dict[str, Any]:
    """parity's tolerance profiles, no scenario: a machine gets its own in platforms/perf/ via ``parity recalibrate perf``."""
    own = read_json(default_baselines_dir() / PERF_BASE_FILE)
    doc = {
        "_comment": "Perf baselines in sglang's perf_baselines.json schema: the tolerances here, each machine's "
        "scenarios in platforms/perf/<platform>.json (`parity gate --perf` 3 times, then "
        "`parity recalibrate perf --write`); on shared runners time HEAD against BASE with `parity perf`.",
        "metadata": {
            "model": "this project's image cases",
            "hardware": "per machine in platforms/perf/<platform>.json",
        },
        "scenarios": {},
        "tolerances": own["tolerances"],
    }
    PerfBaselines.from_json(doc, PERF_BASE_FILE)
    return doc


def write_skeleton(root: Path, images_only: bool = False) -> Skeleton:
    """Write the project into ``root`` (created when absent); refused, writing nothing, when any file exists
    or ``root`` lies inside parity itself (its writes would land in parity's checkout or package)."""
    root = root.resolve()
    if is_inside_package(root) or root.is_relative_to(parity_home().resolve()):
        raise ConfigError(
            "is inside parity itself: a project belongs in a repository of your own", path=root, key="DIR"
        )
    texts: dict[Path, str] = {
        root / PROJECT_FILE: PROJECT_TEXT,
        root / CASES / "images" / "example.toml": IMAGE_TEXT,
        root / BASELINES / THRESHOLDS_FILE: dump_json(_thresholds()),
        root / BASELINES / PERF_BASE_FILE: dump_json(_perf()),
    }
    if not images_only:
        texts[root / CASES / "contracts" / "example.toml"] = CONTRACT_TEXT
    _folders(root, list(texts))
    present = sorted(str(p) for p in texts if _exists(p))
    if present:
        raise ConfigError(f"already exist(s), nothing was written: {', '.join(present)}", path=root, key="DIR")
    _write_all(root, texts)
    first = [] if root == Path.cwd().resolve() else [f"cd {shlex.quote(str(root))}"]
    steps = [*(["parity check"] if not images_only else []), "parity bless --all", f"parity gate --report {REPORT}"]
    return Skeleton(root, tuple(sorted(texts)), tuple(first + steps))


def _exists(path: Path) -> bool:
    """Whether anything (a dangling link too) is at ``path``; a path the system refuses (too long) is an error."""
    try:
        return path.exists() or path.is_symlink()
    except OSError as exc:
        raise ConfigError(f"cannot be used: {exc.strerror or exc}", path=path, key="DIR") from None


def _folders(root: Path, files: Sequence[Path]) -> list[Path]:
    """The folders the files need, parents first; a path on the way that exists but is no folder refuses."""
    needed = sorted({root / f for file in files for f in file.relative_to(root).parents}, key=lambda p: len(p.parts))
    for path in needed:
        if _exists(path) and not path.is_dir():
            raise ConfigError("exists and is not a folder: nothing was written", path=path, key="DIR")
    return needed


def _write_all(root: Path, texts: dict[Path, str]) -> None:
    """Every file or none: on an error the files and folders made so far are removed again."""
    folders = [f for f in _folders(root, list(texts)) if not _exists(f)]
    made: list[Path] = []
    try:
        for folder in folders:
            folder.mkdir()
            made.append(folder)
        for path, text in texts.items():
            write_bytes_atomic(path, text.encode("utf-8"))
            made.append(path)
    except OSError as exc:
        for path in reversed(made):
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
        where = Path(exc.filename) if isinstance(exc.filename, str) else root
        raise ConfigError(
            f"cannot be written ({exc.strerror or exc}): nothing was written", path=where, key="DIR"
        ) from None


def describe(skeleton: Skeleton) -> Sequence[str]:
    """The lines ``parity init`` prints."""
    lines = [f"wrote {p.relative_to(skeleton.root)}" for p in skeleton.files]
    return [f"project in {skeleton.root}:", *lines, "next:", *(f"  {c}" for c in skeleton.next_commands)]
