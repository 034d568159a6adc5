"""What the preloaded server (multiprocessing's forkserver) sets up first: it is the first module it imports.

The server forks every CPU rank, so it is the one process still running when the parity process
that started it was killed (it exits when its "alive" pipe reaches EOF; it starts with SIGINT
blocked). Imported there, and a no-op elsewhere, this module makes the server a child subreaper
that kills every descendant left at its exit, so nothing outlives parity even after a SIGKILL;
gives the ranks a temporary folder of their own inside the parity process's ``pymp-*`` folder
(:data:`RANKS_TMPDIR_ENV`), removed at either's exit, so a rank killed while it held a temporary
file leaves nothing; and removes at its exit the listener socket that a killed parity left.
"""

from __future__ import annotations

import atexit
import multiprocessing.forkserver
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from harness.processes import PR_SET_CHILD_SUBREAPER, kill_descendants, prctl

RANKS_TMPDIR_ENV = "PARITY_RANKS_TMPDIR"  # set for the server's start only; the ranks do not inherit it


def _in_server() -> bool:
    """Whether this import runs inside the forkserver's ``main`` (its preload)."""
    frame = sys._getframe()  # noqa: SLF001 - the preload's caller is the only sign of being the server
    while frame is not None:
        if frame.f_code is multiprocessing.forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _at_exit(server: int, parent: int, ranks_tmp: str) -> None:
    if os.getpid() != server:  # a rank forked from the server inherited this hook
        return
    kill_descendants()
    shutil.rmtree(ranks_tmp, ignore_errors=True)
    if os.getppid() == parent:
        return  # the parity process lives and removes its own temporary folder
    address = multiprocessing.forkserver._forkserver._forkserver_address  # noqa: SLF001 - set by the server's main
    if isinstance(address, str) and address and not address.startswith("\0"):
        for remove in (lambda: os.unlink(address), lambda: os.rmdir(Path(address).parent)):
            try:
                remove()
            except OSError:
                pass


def _serve() -> None:
    # the server reaps the orphans it adopts in its own loop, which warns about every pid it did not fork
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    ranks_tmp = os.environ.pop(RANKS_TMPDIR_ENV, "") or tempfile.mkdtemp(prefix="parity-ranks-")
    os.makedirs(ranks_tmp, exist_ok=True)
    tempfile.tempdir = ranks_tmp
    atexit.register(_at_exit, os.getpid(), os.getppid(), ranks_tmp)


if _in_server():
    _serve()
