"""A minimal gate project in a temp dir: one quick contract case, the given image case files and the
committed thresholds, the layout ``parity gate --cases DIR --baselines DIR`` reads."""

from __future__ import annotations

import shutil
from pathlib import Path

from harness.paths import default_baselines_dir

QUICK_CONTRACT = '[cases.precedence]\ncontract = "backend.selection_precedence"\nworld_size = 1\n'


def gate_project(root: Path, **image_files: str) -> tuple[Path, Path]:
    """``root/cases`` (contracts/tiny.toml + images/<name>.toml per keyword) and ``root/baselines``
    (the committed consistency_threshold.json, no references yet)."""
    cases, baselines = root / "cases", root / "baselines"
    (cases / "contracts").mkdir(parents=True)
    (cases / "images").mkdir()
    baselines.mkdir()
    (cases / "contracts" / "tiny.toml").write_text(QUICK_CONTRACT)
    for name, text in image_files.items():
        (cases / "images" / f"{name}.toml").write_text(text)
    shutil.copy(default_baselines_dir() / "consistency_threshold.json", baselines)
    return cases, baselines
