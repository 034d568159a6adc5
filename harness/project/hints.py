"""The options a printed command (a hint, a next step) must carry so that, run verbatim from the same
directory, it does what the run that printed it did.

A value is carried when it differs from what the bare command would resolve to: the project file's
value, else parity's default. So a hint stays short inside a project and still works when the run
was given ``--cases``/``--baselines``/``--pipeline-target`` on the command line.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from harness.paths import default_baselines_dir, default_cases_dir
from harness.project.config import Project
from harness.targets.spec import TargetSpec

DEFAULT_DEVICE = "cpu"


def _same_path(a: Path, b: Path | None) -> bool:
    return b is not None and Path(a).resolve() == Path(b).resolve()


def carried_options(
    project: Project | None,
    *,
    cases: Path | None = None,
    baselines: Path | None = None,
    target: TargetSpec | None = None,
    pipeline: TargetSpec | None = None,
    device: str | None = None,
) -> list[str]:
    """The words of the options given here whose value the bare command would not resolve to by itself."""
    p = project
    words: list[str] = []
    if cases is not None and not _same_path(cases, (p and p.cases) or default_cases_dir()):
        words += ["--cases", str(cases)]
    if baselines is not None and not _same_path(baselines, (p and p.baselines) or default_baselines_dir()):
        words += ["--baselines", str(baselines)]
    for spec, option in ((target, "target"), (pipeline, "pipeline_target")):
        if spec is not None and spec != (p.spec_of(option) if p else TargetSpec()):
            flag = f"--{option.replace('_', '-')}"
            words += [flag, spec.name, *(w for key, value in spec.args for w in (f"{flag}-arg", f"{key}={value}"))]
    if device is not None and device != ((p and p.device) or DEFAULT_DEVICE):
        words += ["--device", device]
    return words


def command(words: Sequence[str], carried: Sequence[str] = ()) -> str:
    """``parity WORDS... CARRIED...`` quoted for a POSIX shell."""
    return shlex.join(["parity", *words, *carried])
