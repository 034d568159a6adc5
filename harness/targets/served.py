"""A server parity starts itself (``launch='CMD ... {port}'``): on a free port, ready-polled, stopped with its whole tree.

The command runs under the same keeper as a command pipeline's (:mod:`harness.targets.command_keeper`:
a child subreaper in a session of its own that kills every process the server started, its own
sessions included, when told, when the server exits, or when parity dies, SIGKILL included). Its
stdout and stderr go to a log file in a temporary folder that the keeper removes if parity dies;
every error about the server quotes the log's last lines. Readiness is a ``200`` from one of
:data:`READY_PATHS` (sglang answers ``/health``; OpenAI-compatible servers ``/v1/models``). The port is free
when picked but may be taken before the server binds it: :func:`launch` then tries another.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.targets.base import PipelineFailed
from harness.targets.command_run import KEEPER, end_keeper

READY_PATHS = ("/health", "/v1/models")
LOG_TAIL_LINES = 40
LOG_TAIL_BYTES = 64 * 1024
_POLL_S = 0.2
_PROBE_TIMEOUT_S = 2.0
PORT_ATTEMPTS = 3


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def answers(url: str, timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether ``url`` answers a GET with a 2xx status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - the user's own server
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


class LaunchedServer:
    """One launch of a server command: started, waited for, stopped (module docstring)."""

    def __init__(self, template: str, ready_timeout: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [arg.replace("{port}", str(self.port)) for arg in shlex.split(template)]
        self._folder = Path(tempfile.mkdtemp(prefix="parity-server-"))
        self.log = self._folder / "server.log"
        self._keeper: subprocess.Popen[bytes] | None = None
        self._status_r: int | None = None
        self._ended: str | None = None
        try:
            self._start()
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        status_r, status_w = os.pipe()
        self._status_r = status_r
        try:
            with open(self.log, "wb") as log:
                self._keeper = subprocess.Popen(
                    [
                        sys.executable,
                        "-I",
                        "-S",
                        KEEPER,
                        str(status_w),
                        str(os.getpid()),
                        str(self._folder),
                        *self.argv,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(status_w,),
                    start_new_session=True,
                )
        except OSError as exc:
            raise PipelineFailed(f"cannot start the server's keeper: {exc}: {shlex.join(self.argv)}") from None
        finally:
            os.close(status_w)

    def _wait_ready(self, timeout: float) -> None:
        """Poll :data:`READY_PATHS` until one answers, the server exits, or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # poll: the server's readiness
            if self.exited() is not None:
                raise self.failure(f"the server exited before it was ready ({self.exited()})")
            if any(answers(self.url + path) for path in READY_PATHS):
                return
            time.sleep(_POLL_S)
        raise self.failure(
            f"the server was not ready after {timeout:g} s (no 200 from {' or '.join(READY_PATHS)} at {self.url})"
        )

    def exited(self, wait: float = 0.0) -> str | None:
        """How the server ended (``"exit status 1"``), or None while it runs (waiting up to ``wait`` s for an end)."""
        if self._ended is not None or self._keeper is None:
            return self._ended
        try:
            self._keeper.wait(wait)
        except subprocess.TimeoutExpired:
            return None
        status = b""
        if self._status_r is not None:
            os.set_blocking(self._status_r, False)
            try:
                status = os.read(self._status_r, 4096)
            except BlockingIOError:
                pass
        text = status.decode(errors="replace").strip()
        head = text.partition(" ")[0]
        if head.lstrip("-").isdigit():
            code = int(head)
            self._ended = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        else:
            self._ended = text or "its keeper ended"
        return self._ended

    def log_tail(self) -> str:
        """The last :data:`LOG_TAIL_LINES` lines of the server's output."""
        try:
            with open(self.log, "rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                text = fh.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])

    def failure(self, what: str) -> PipelineFailed:
        """``what``, naming the command, with the log's tail as the detail (and its last line in the reason)."""
        tail = self.log_tail()
        last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "no output")
        return PipelineFailed(f"{what}: {shlex.join(self.argv)} (last log line: {last[:200]})", tail)

    def stop(self) -> None:
        """End the server and everything it started (bounded: :func:`end_keeper`), remove its folder."""
        if self._keeper is not None:
            end_keeper(self._keeper)
            self._keeper = None
        if self._status_r is not None:
            os.close(self._status_r)
            self._status_r = None
        shutil.rmtree(self._folder, ignore_errors=True)


def launch(template: str, ready_timeout: float) -> LaunchedServer:
    """A ready server of ``template``, on another free port where another process bound the picked one first
    (its log says "address already in use"; :data:`PORT_ATTEMPTS` ports at most)."""
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return LaunchedServer(template, ready_timeout)
        except PipelineFailed as exc:
            if "address already in use" not in f"{exc.reason}\n{exc.detail}".lower():
                raise
    return LaunchedServer(template, ready_timeout)
