"""Running one external command so that it can neither hang the gate, fill its memory, nor outlive its case.

The command runs under a keeper (:mod:`harness.targets.command_keeper`, a child subreaper in a
session of its own) that kills every process the command started, own sessions included, as soon
as the command exits or the gate says so. The gate reads the command's stdout and stderr itself,
keeping only the last :data:`TAIL_BYTES` of each (a command printing gigabytes costs nothing), until
both reach EOF, which they do once the keeper has killed everything holding them. Every wait is
bounded: on the timeout the keeper is told to end the command; if the keeper does not end within
:data:`END_GRACE_S` it is killed and the pipes are abandoned.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KEEPER = str(Path(__file__).with_name("command_keeper.py"))
TAIL_BYTES = 64 * 1024
END_GRACE_S = 15.0  # the keeper's hunt for the command's processes is bounded by 10 s
_EOF_GRACE_S = 2.0  # after the keeper ended: output still held by a process that escaped it (no subreaper) is abandoned
_POLL_S = 0.5


@dataclass(frozen=True)
class Finished:
    """How a command ended: ``returncode`` (negative: killed by that signal; None: it did not finish,
    see ``timed_out`` and ``error``), its own wall time, and the tails of its output."""

    returncode: int | None
    wall_ms: float | None
    stdout: str
    stderr: str
    timed_out: bool = False
    error: str | None = None  # why it did not start, or why no status came back


class _Tail:
    """The last ``limit`` bytes written to a stream."""

    def __init__(self, limit: int = TAIL_BYTES) -> None:
        self.limit, self.data = limit, bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > self.limit:
            del self.data[: len(self.data) - self.limit]

    def text(self) -> str:
        return self.data.decode(errors="replace")


def end_keeper(keeper: subprocess.Popen[bytes]) -> None:
    """Ask the keeper to end the command's processes, wait for it (bounded), kill it if it does not end."""
    if keeper.poll() is None:
        try:
            keeper.send_signal(signal.SIGTERM)
            keeper.wait(END_GRACE_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(keeper.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            keeper.wait()


def _status(text: str) -> tuple[int | None, float | None, str | None]:
    """The keeper's status line: ``"<returncode> <wall ns>"`` or ``"error <why>"``."""
    head, _, rest = text.strip().partition(" ")
    if head == "error":
        return None, None, f"cannot start the command: {rest}"
    try:
        return int(head), int(rest) / 1e6, None
    except ValueError:
        return None, None, "its keeper ended without saying how the command ended"


def _drain(keeper: subprocess.Popen[bytes], tails: dict[int, _Tail], status_r: int, timeout: float) -> bool:
    """Read the keeper's pipes into ``tails`` until they close; whether ``timeout`` passed first (then the keeper
    was told to end, and its pipes are abandoned after :data:`END_GRACE_S`, or :data:`_EOF_GRACE_S` after it ended)."""
    timed_out = finishing = False
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for fd in tails:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            if not finishing and status_r not in selector.get_map() and keeper.poll() is not None:
                finishing, deadline = True, min(deadline, now + _EOF_GRACE_S)
            if now >= deadline:
                if timed_out or finishing:
                    break  # the keeper ended, or did not end in its grace: abandon the pipes
                timed_out, deadline = True, now + END_GRACE_S
                keeper.send_signal(signal.SIGTERM)
            for key, _ in selector.select(min(max(deadline - now, 0.0), _POLL_S)):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    tails[key.fd].add(chunk)
                else:
                    selector.unregister(key.fd)
    return timed_out


def run_command(argv: list[str], timeout: float, out_dir: Path) -> Finished:
    """Run ``argv`` (stdin /dev/null) under a keeper; how it ended, within ``timeout`` seconds. ``out_dir``, the
    command's output folder, is the caller's to remove; the keeper removes it only if the caller died."""
    status_r, status_w = os.pipe()
    try:
        keeper = subprocess.Popen(
            [sys.executable, "-I", "-S", KEEPER, str(status_w), str(os.getpid()), str(out_dir), *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
        )
    except OSError as exc:
        os.close(status_r)
        return Finished(None, None, "", "", error=f"cannot start the command's keeper: {exc}")
    finally:
        os.close(status_w)
    assert keeper.stdout is not None and keeper.stderr is not None
    stdout, stderr, status = _Tail(), _Tail(), _Tail(4096)
    tails = {keeper.stdout.fileno(): stdout, keeper.stderr.fileno(): stderr, status_r: status}
    try:
        timed_out = _drain(keeper, tails, status_r, timeout)
    finally:
        end_keeper(keeper)
        os.close(status_r)
        keeper.stdout.close()
        keeper.stderr.close()
    if timed_out:
        return Finished(None, None, stdout.text(), stderr.text(), timed_out=True)
    code, wall_ms, error = _status(status.text())
    return Finished(code, wall_ms, stdout.text(), stderr.text(), error=error)
