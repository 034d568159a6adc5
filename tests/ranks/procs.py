"""Process inspection for the rank tests, read from /proc: who is alive, whose child, what is left."""

from __future__ import annotations

import os
import time
from pathlib import Path

# Processes that live as long as the process that started them, not as long as a group.
LONG_LIVED = (b"resource_tracker", b"forkserver")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "pid (comm)": state, ppid, pgrp, ... (None when gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def alive(pid: int) -> bool:
    """True while the pid exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def children(parent: int, *, long_lived: bool = False) -> set[int]:
    """Pids whose parent is ``parent`` (the long-lived helpers only when asked for)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if (
            fields is not None
            and int(fields[1]) == parent
            and (long_lived or not any(n in cmdline for n in LONG_LIVED))
        ):
            found.add(int(entry))
    return found


def descendants(root: int) -> set[int]:
    """Every process below ``root``, helpers included."""
    found, frontier = set(), {root}
    while frontier:
        below = set().union(*(children(p, long_lived=True) for p in frontier)) - found
        found |= below
        frontier = below
    return found


def live_children() -> set[int]:
    """This process's children, its long-lived helpers excepted."""
    return children(os.getpid())


def wait_until_gone(pids: set[int] | list[int], seconds: float) -> list[int]:
    """Wait up to ``seconds`` for every pid to end; the ones still alive."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def parity_files(folder: Path) -> list[Path]:
    """What the launcher could have left in a temp dir (it should leave nothing)."""
    return sorted(folder.glob("parity-*"))


def assert_all_ended(pids: list[int], children_before: set[int]) -> None:
    assert pids, "the test should have recorded the ranks' pids"
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "a rank process remains (or was not reaped)"
    assert live_children() <= children_before, "a child process remains"


def tagged(variable: str, value: str) -> list[int]:
    """Live processes (zombies aside) whose environment has ``variable=value``: a run and everything below it,
    whatever session or process group they moved to (every descendant inherits its environment)."""
    needle = f"{variable}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and alive(int(entry)):
            found.append(int(entry))
    return found


def kill_tagged(variable: str, value: str) -> None:
    """SIGKILL every process :func:`tagged` finds (a failed test must not leave them running)."""
    import signal

    for pid in tagged(variable, value):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
