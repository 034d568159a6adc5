"""The keeper of one external command: started by :mod:`harness.targets.command_run` as a script.

``python -I -S command_keeper.py STATUS_FD ARGV...`` runs ARGV in a session of its own and, when
it exits, writes ``"<returncode> <wall ns>"`` to STATUS_FD, then kills every process the command
left behind before exiting itself. The keeper is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``):
whatever the command starts stays its descendant even after a double fork or ``setsid()``, so
none outlives the case, and none keeps the gate's pipes open (the gate reads them until EOF). On
SIGTERM (the gate's timeout), SIGINT, SIGHUP or the gate's death (``PR_SET_PDEATHSIG``) it does
the same at once. Standard library only, no ``harness`` import: it starts in a few milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_KILL_ROUNDS_S = 10.0  # how long the tree is hunted down (a process in uninterruptible sleep may take a while)
_ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _Ended(Exception):
    """One of :data:`_ENDING` arrived."""


def _end(signum: int, frame: object) -> None:
    for sig in _ENDING:
        signal.signal(sig, signal.SIG_IGN)
    raise _Ended(signum)


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def _children_of() -> dict[int, list[int]]:
    """Parent pid -> child pids of every process this user can see (``/proc/<pid>/stat``)."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # the command name may hold spaces and parentheses
        tree.setdefault(int(fields[1]), []).append(int(name))
    return tree


def _descendants(root: int) -> list[int]:
    tree, out, todo = _children_of(), [], [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _reap() -> bool:
    """Reap every child that has ended; False once the keeper has no child left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def kill_tree(session: int | None) -> None:
    """Kill the command's session and every descendant of this keeper, until none is left."""
    if session is not None:
        try:
            os.killpg(session, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if not os.path.isdir("/proc"):
        return
    deadline = time.monotonic() + _KILL_ROUNDS_S
    while time.monotonic() < deadline:
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not _reap():
            return
        time.sleep(0.005)


def main(argv: list[str]) -> int:
    status_fd, command = int(argv[0]), argv[1:]
    parent = os.getppid()
    for sig in _ENDING:
        signal.signal(sig, _end)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    proc = None
    try:
        if os.getppid() != parent:  # the gate died before the death signal was armed
            return 1
        start = time.perf_counter_ns()
        try:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            os.write(status_fd, f"error {exc}\n".encode(errors="replace"))
            return 0
        code = proc.wait()
        os.write(status_fd, f"{code} {time.perf_counter_ns() - start}\n".encode())
        return 0
    except _Ended:
        return 1
    finally:
        for sig in _ENDING:  # nothing interrupts the hunt
            signal.signal(sig, signal.SIG_IGN)
        kill_tree(proc.pid if proc is not None else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
