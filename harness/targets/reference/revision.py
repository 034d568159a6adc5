"""``rev:GITREV``: parity's own pipeline as another commit has it, for timing two commits side by side.

The parent exports that commit's ``reference_impl`` (``git archive``: nothing is written into the repository, not
even a worktree entry) into a temporary tree; a rank that prepares the target imports ``reference_impl`` from there,
and this harness's adapters with it. The measuring side stays this checkout's, as asv times two commits with one
benchmark suite: only the code under test changes. A process can hold one ``reference_impl`` at a time, so a rank
serves one commit for its life (the perf stage gives each side its own pool). Fields are checked in the parent by
this checkout's reference target; a field the commit does not know fails when its ranks prepare it, with the
commit's own error.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import subprocess
import sys
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.errors import ConfigError
from harness.targets.base import PipelineTarget, PreparedPipeline

PREFIX = "rev:"
PACKAGE = "reference_impl"
_ADAPTERS = "harness.targets.reference"
_GIT_TIMEOUT_S = 120.0


def _git(repo: Path, *args: str, what: str) -> subprocess.CompletedProcess[bytes]:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=_GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot run git for {what}: {exc}", path=repo) from None
    if done.returncode != 0:
        raise ConfigError(f"{what}: {done.stderr.decode(errors='replace').strip() or 'git failed'}", path=repo)
    return done


def default_repo() -> Path:
    """The git checkout this process imports ``reference_impl`` from (a wheel install has none)."""
    spec = importlib.util.find_spec(PACKAGE)
    package = Path(spec.origin).parent if spec is not None and spec.origin else None
    if package is None:
        raise ConfigError(f"{PACKAGE} cannot be found")
    checkout = package.parent
    top = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != checkout.resolve():
        raise ConfigError(
            f"rev: needs parity's own git checkout, and {PACKAGE} is imported from {package}, which is not "
            "at the top of one; name the checkout with the side's argument repo=DIR"
        )
    return checkout


def resolve_commit(rev: str, repo: Path) -> str:
    """The full commit id ``rev`` names in ``repo`` (ConfigError naming both when it names none)."""
    if not rev or rev.startswith("-"):
        raise ConfigError(f"{PREFIX}{rev!r} does not name a revision", key="rev")
    return (
        _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", what=f"{PREFIX}{rev}")
        .stdout.decode()
        .strip()
    )


def export_tree(repo: Path, commit: str, into: Path) -> Path:
    """``reference_impl`` as ``commit`` has it, written under ``into`` (which must be empty); returns ``into``."""
    archive = _git(
        repo, "archive", "--format=tar", commit, PACKAGE, what=f"{PREFIX}{commit[:12]}: git archive {PACKAGE}"
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")  # a member that would land outside ``into`` is refused
    if not (into / PACKAGE / "__init__.py").is_file():
        raise ConfigError(f"commit {commit[:12]} has no {PACKAGE} package", path=repo)
    return into


def _import_from(tree: Path) -> Any:
    """This process's ``reference_impl`` (and the adapters bound to it) from ``tree``; the pipeline adapter module."""
    loaded = sys.modules.get(PACKAGE)
    if loaded is not None and Path(loaded.__file__ or "").resolve().is_relative_to(tree.resolve()):
        return importlib.import_module(f"{_ADAPTERS}.pipeline")
    for name in list(sys.modules):
        if name == PACKAGE or name.startswith(f"{PACKAGE}.") or (name.startswith(_ADAPTERS) and name != __name__):
            del sys.modules[name]
    sys.path.insert(0, str(tree))
    importlib.invalidate_caches()
    module = importlib.import_module(f"{_ADAPTERS}.pipeline")
    origin = Path(sys.modules[PACKAGE].__file__ or "").resolve()
    if not origin.is_relative_to(tree.resolve()):
        raise RuntimeError(f"{PACKAGE} was imported from {origin}, not from the exported commit at {tree}")
    return module


class RevisionPipelineTarget(PipelineTarget):
    """The reference pipeline of one commit; ``tree`` is its exported ``reference_impl`` (set by the perf stage)."""

    name = "rev"

    def __init__(self, rev: str, repo: str | None = None, tree: str | None = None, commit: str | None = None) -> None:
        self.rev, self.repo, self.tree, self.commit = rev, repo, tree, commit

    def check_case(self, fields: Mapping[str, Any], world_size: int) -> str:
        from harness.targets.reference.pipeline import ReferencePipelineTarget

        return ReferencePipelineTarget().check_case(fields, world_size)

    def prepare(self, fields: Mapping[str, Any], device: str, world_size: int | None = None) -> PreparedPipeline:
        if self.tree is None:
            raise ConfigError(
                f"{PREFIX}{self.rev} runs as a side of a perf A/B only (parity perf BASE HEAD, "
                "parity gate --perf-base SPEC), which exports the commit first",
                key="target",
            )
        return _import_from(Path(self.tree)).ReferencePipelineTarget().prepare(fields, device, world_size)


def factory(
    rev: str, repo: str | None = None, tree: str | None = None, commit: str | None = None
) -> RevisionPipelineTarget:
    return RevisionPipelineTarget(rev, repo, tree, commit)
