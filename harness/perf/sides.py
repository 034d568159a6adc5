"""The two sides of an A/B: pipeline target specs as ``--pipeline-target`` takes them, plus ``rev:GITREV``.

A ``rev:`` side is resolved once per run (:class:`Revisions`): the commit id is looked up in the
checkout (or the side's ``repo=DIR``), its ``reference_impl`` exported into a temporary tree that
the side's ranks import from (:mod:`harness.targets.reference.revision`), and the tree removed when
the run ends; a run killed by SIGKILL leaves its tree, removed by the next run's start (its pid is in the name). Both ``rev:main`` and ``rev:<sha of main>`` then name the same commit in the report.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from harness.targets.spec import REVISION_PREFIX, TargetSpec

BASE, HEAD = "base", "head"


def versus(base: TargetSpec, head: TargetSpec) -> str:
    """Both sides of an A/B as a record names what ran it (``rev:main vs openai``)."""
    return f"{base.name} vs {head.name}"


TREE_PREFIX = "parity-rev-"


def _owner_alive(tree: Path) -> bool:
    """Whether the process named in a tree's name (``parity-rev-<commit>-p<pid>-...``) still runs."""
    match = re.fullmatch(rf"{TREE_PREFIX}[0-9a-f]+-p(\d+)-.*", tree.name)
    if match is None:
        return True  # not a name this parity gives: not ours to remove
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_orphaned_trees(directory: Path | None = None) -> list[Path]:
    """Remove the exported trees of runs that were killed (SIGKILL leaves no exit hook to run); the removed."""
    root = Path(directory or tempfile.gettempdir())
    orphans = [
        t for t in root.glob(f"{TREE_PREFIX}*-p*-*") if t.is_dir() and not t.is_symlink() and not _owner_alive(t)
    ]
    for tree in orphans:
        shutil.rmtree(tree, ignore_errors=True)
    return orphans


class Revisions:
    """Resolves ``rev:`` sides for one run; each commit exported once, every tree removed on exit, and the trees
    of killed runs (their owner's pid in the name, gone) removed at the start."""

    def __init__(self) -> None:
        self._trees: dict[tuple[str, str], Path] = {}
        remove_orphaned_trees()

    def resolve(self, side: TargetSpec) -> TargetSpec:
        """``side`` itself, or for ``rev:GITREV`` the same side with ``commit`` and ``tree`` set."""
        if not side.is_revision:
            return side
        from harness.targets.reference.revision import default_repo, export_tree, resolve_commit

        args = dict(side.args)
        repo = Path(args["repo"]) if "repo" in args else default_repo()
        commit = resolve_commit(side.name[len(REVISION_PREFIX) :], repo)
        key = (str(repo.resolve()), commit)
        if key not in self._trees:
            tree = Path(tempfile.mkdtemp(prefix=f"{TREE_PREFIX}{commit[:12]}-p{os.getpid()}-"))
            try:
                export_tree(repo, commit, tree)
            except BaseException:
                shutil.rmtree(tree, ignore_errors=True)
                raise
            self._trees[key] = tree
        return side.with_args(commit=commit, tree=str(self._trees[key]))

    def close(self) -> None:
        for tree in self._trees.values():
            shutil.rmtree(tree, ignore_errors=True)
        self._trees.clear()

    def __enter__(self) -> Revisions:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
