"""The two sides of an A/B: pipeline target specs as ``--pipeline-target`` takes them, plus ``rev:GITREV``.

A ``rev:`` side is resolved once per run (:class:`Revisions`): the commit id is looked up in the
checkout (or the side's ``repo=DIR``), its ``reference_impl`` exported into a temporary tree that
the side's ranks import from (:mod:`harness.targets.reference.revision`), and the tree removed when
the run ends. Both ``rev:main`` and ``rev:<sha of main>`` then name the same commit in the report.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.targets.loader import REVISION_PREFIX, TargetArgs

BASE, HEAD = "base", "head"


@dataclass(frozen=True)
class Side:
    """A pipeline target spec and its factory arguments."""

    target: str
    args: TargetArgs = ()

    @property
    def is_revision(self) -> bool:
        return self.target.startswith(REVISION_PREFIX)

    def describe(self) -> dict[str, Any]:
        """As a results document records it (a revision with its commit)."""
        args = dict(self.args)
        shown = {k: v for k, v in args.items() if k != "tree"}
        return {"target": self.target, "args": shown, **({"commit": args["commit"]} if "commit" in args else {})}


class Revisions:
    """Resolves ``rev:`` sides for one run; each commit exported once, every tree removed on exit."""

    def __init__(self) -> None:
        self._trees: dict[tuple[str, str], Path] = {}

    def resolve(self, side: Side) -> Side:
        """``side`` itself, or for ``rev:GITREV`` the same side with ``commit`` and ``tree`` set."""
        if not side.is_revision:
            return side
        from harness.targets.reference.revision import default_repo, export_tree, resolve_commit

        args = dict(side.args)
        repo = Path(args["repo"]) if "repo" in args else default_repo()
        commit = resolve_commit(side.target[len(REVISION_PREFIX) :], repo)
        key = (str(repo.resolve()), commit)
        if key not in self._trees:
            tree = Path(tempfile.mkdtemp(prefix=f"parity-rev-{commit[:12]}-"))
            try:
                export_tree(repo, commit, tree)
            except BaseException:
                shutil.rmtree(tree, ignore_errors=True)
                raise
            self._trees[key] = tree
        return Side(side.target, tuple(sorted({**args, "commit": commit, "tree": str(self._trees[key])}.items())))

    def close(self) -> None:
        for tree in self._trees.values():
            shutil.rmtree(tree, ignore_errors=True)
        self._trees.clear()

    def __enter__(self) -> Revisions:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
