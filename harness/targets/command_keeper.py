"""The keeper of one external command: started by :mod:`harness.targets.command_run` as a script.

``python -I -S command_keeper.py STATUS_FD GATE_PID OUT_DIR ARGV...`` runs ARGV in a session of its
own, writes ``"<returncode> <wall ns>"`` to STATUS_FD when it exits, then kills every process it
left; if the gate died first, it removes OUT_DIR too. As a child subreaper (:mod:`harness.processes`)
it keeps whatever the command starts as its descendant, even after ``setsid()``, so none outlives
the case or holds the gate's pipes open. On SIGTERM (the gate's timeout), SIGINT, SIGHUP or the
gate's death (``PR_SET_PDEATHSIG``: SIGUSR2, which comes when the starting thread ends, so it waits
for its reparenting before deciding) it does the same at once. It imports only
:mod:`harness.processes`, so it starts in milliseconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the folder holding the harness package

from harness.processes import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, kill_descendants, prctl  # noqa: E402

_GATE_DIED = signal.SIGUSR2  # the death signal: told apart from the gate's own SIGTERM
_ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, _GATE_DIED)
_REPARENT_WAIT_S = 5.0


class _Ended(Exception):
    """One of :data:`_ENDING` arrived."""


def _end(signum: int, frame: object) -> None:
    for sig in _ENDING:
        signal.signal(sig, signal.SIG_IGN)
    raise _Ended(signum)


def main(argv: list[str]) -> int:
    status_fd, parent, out_dir, command = int(argv[0]), int(argv[1]), argv[2], argv[3:]
    for sig in _ENDING:
        signal.signal(sig, _end)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, _GATE_DIED)
    session, gate_died = None, False
    try:
        if os.getppid() != parent:  # the gate died before the death signal was armed (while this interpreter started)
            return 1
        start = time.perf_counter_ns()
        try:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            os.write(status_fd, f"error {exc}\n".encode(errors="replace"))
            return 0
        session = proc.pid
        code = proc.wait()
        os.write(status_fd, f"{code} {time.perf_counter_ns() - start}\n".encode())
        return 0
    except _Ended as ended:
        gate_died = ended.args[0] == _GATE_DIED
        return 1
    finally:
        for sig in _ENDING:  # nothing interrupts the hunt
            signal.signal(sig, signal.SIG_IGN)
        if session is not None:
            try:
                os.killpg(session, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        kill_descendants()
        if gate_died:  # sent as the gate's first thread ends: its others may still be ending, its pid still ours
            deadline = time.monotonic() + _REPARENT_WAIT_S
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.01)
        if os.getppid() != parent:  # the gate is gone: nobody else will remove the folder
            shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
