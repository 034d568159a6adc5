"""A minimal gate project in a temp dir: one quick contract case, the given image case files and the
committed thresholds, the layout ``parity gate --cases DIR --baselines DIR`` reads."""

from __future__ import annotations

import shutil
from pathlib import Path

from harness.paths import default_baselines_dir

QUICK_CONTRACT = '[cases.precedence]\ncontract = "backend.selection_precedence"\nworld_size = 1\n'
CLIP_PIN = 'unmeasured = { clip = "no CLIP model configured" }\n'


def clip_pinned(text: str) -> str:
    """An image case file whose cases may leave the clip bound unmeasured (tests gate without a CLIP model)."""
    if "[defaults]\n" in text:
        return text.replace("[defaults]\n", "[defaults]\n" + CLIP_PIN, 1)
    return "[defaults]\n" + CLIP_PIN + text


def gate_project(root: Path, **image_files: str) -> tuple[Path, Path]:
    """``root/cases`` (contracts/tiny.toml + images/<name>.toml per keyword, clip pinned as unmeasured) and
    ``root/baselines`` (the committed consistency_threshold.json, no references yet)."""
    cases, baselines = root / "cases", root / "baselines"
    (cases / "contracts").mkdir(parents=True)
    (cases / "images").mkdir()
    baselines.mkdir()
    (cases / "contracts" / "tiny.toml").write_text(QUICK_CONTRACT)
    for name, text in image_files.items():
        (cases / "images" / f"{name}.toml").write_text(clip_pinned(text))
    shutil.copy(default_baselines_dir() / "consistency_threshold.json", baselines)
    return cases, baselines
