"""Process trees: what a parity process (a command's keeper, the preloaded server, a rank) starts dies with it.

Killing a process group misses a descendant that called ``setsid()`` (a daemon, a server started in
the background), and on its parent's death such a process is adopted by init and lives on. A
*child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``) adopts its orphaned descendants instead, so
they stay reachable through parent links: :func:`kill_descendants` finds them in ``/proc`` and kills
them until none is left. Standard library only: the command keeper imports this module without
the rest of parity.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

__all__ = ["PR_SET_CHILD_SUBREAPER", "PR_SET_PDEATHSIG", "descendants", "kill_descendants", "prctl"]

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_HUNT_S = 10.0  # how long a tree is hunted down (a process in uninterruptible sleep takes a while to die)


def prctl(option: int, value: int) -> bool:
    """Linux ``prctl(option, value)``; False where it is not available or refused."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def _live_children() -> dict[int, list[int]]:
    """Parent pid -> pids of its children that have not ended (zombies excluded), from ``/proc/<pid>/stat``."""
    tree: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return tree
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # the command name may hold spaces and parentheses
        if fields and fields[0] != b"Z":
            tree.setdefault(int(fields[1]), []).append(int(name))
    return tree


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (children first)."""
    tree, out, todo = _live_children(), [], [root]
    while todo:
        for child in tree.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def _reap_children() -> None:
    """Reap every ended child of this process (an adopted orphan included), without waiting."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_descendants(root: int | None = None, spare: frozenset[int] = frozenset()) -> None:
    """SIGKILL every descendant of ``root`` (default: this process) but ``spare`` until none is left, reaping
    this process's own children. A descendant forked meanwhile is caught in the next round: its parent's
    death hands it to the nearest subreaper, ``root`` when that is one."""
    root = os.getpid() if root is None else root
    deadline = time.monotonic() + _HUNT_S
    while time.monotonic() < deadline:
        found = [pid for pid in descendants(root) if pid not in spare]
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if root == os.getpid():
            _reap_children()
        time.sleep(0.005)
    if root == os.getpid():
        _reap_children()
