"""The body of one rank process started by :mod:`harness.ranks.group`.

Protocol: pickled tuples over a pipe. The parent sends ``(fn, args)`` or ``b""`` (stop); the rank
answers ``("ready", None)`` once, then ``("ok", result)`` or ``("err", text)`` per call. A second,
one-way pipe carries the stack of every thread, written by faulthandler on ``SIGUSR1`` (a timeout)
or on a crash. First a rank makes sure it cannot outlive the parent and that teardown ends what it
starts: its own process group (one ``killpg``), a child subreaper (:mod:`harness.processes`), and
``PR_SET_PDEATHSIG``; forked by the preloaded server, it closes its copy of the server's "alive"
pipe at once (:mod:`harness.ranks.server`). A rank whose parent is gone exits quietly: the parent,
if alive, reports how it ended, and a traceback per rank would bury the one line that says why.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import NoReturn

import torch
import torch.distributed as dist

from harness.processes import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, kill_descendants, prctl

READY, OK, ERR = "ready", "ok", "err"
STOP = b""
STACK_SIGNAL = signal.SIGUSR1
LOCALHOST = "127.0.0.1"
_PARENT_POLL_S = 0.5
_ORPHAN_EXIT_CODE = 70

_device: torch.device | None = None
_stack_pipe: Connection | None = None  # kept referenced: faulthandler writes to its fd


def current_device() -> torch.device:
    """The device of the rank running in this process; an error outside a rank, so misuse is loud."""
    if _device is None:
        raise RuntimeError("rank_device() was called outside a rank started by harness.ranks")
    return _device


def set_device(device: torch.device) -> None:
    """Record this process's rank device."""
    global _device
    _device = device
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _die_with_parent() -> None:
    """Tie this process's life to the parent's, without needing the GIL once the parent is gone."""
    os.setpgid(0, 0)  # teardown kills this group: the rank and every process it started
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # ... and, through parent links, what escaped the group
    if prctl(PR_SET_PDEATHSIG, signal.SIGKILL):
        server = multiprocessing.forkserver._forkserver  # noqa: SLF001 - the alive pipe has no public handle
        if server._forkserver_alive_fd is not None:  # noqa: SLF001
            os.close(server._forkserver_alive_fd)  # noqa: SLF001
            server._forkserver_alive_fd = None  # noqa: SLF001
        if not _parent_alive():  # it died before the death signal was armed
            os._exit(_ORPHAN_EXIT_CODE)
        return
    threading.Thread(target=_exit_when_orphaned, daemon=True, name="parity-orphan-watchdog").start()


def _parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is not None and parent.is_alive()


def _exit_when_orphaned() -> None:
    """Where the kernel offers no death signal: exit once the parent is gone (needs the GIL to run)."""
    while _parent_alive():
        time.sleep(_PARENT_POLL_S)
    os._exit(_ORPHAN_EXIT_CODE)


def _dump_stacks_to(stack_pipe: Connection) -> None:
    """faulthandler writes every thread's stack into the pipe on STACK_SIGNAL and on a fatal error."""
    global _stack_pipe
    _stack_pipe = stack_pipe
    fd = stack_pipe.fileno()
    os.set_blocking(fd, False)  # a dump larger than the pipe is cut short rather than blocking the rank
    faulthandler.enable(file=fd, all_threads=True)
    faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True)


def _limit_threads() -> None:
    """One intra-op thread per rank unless the user chose (N ranks on few cores otherwise oversubscribe).
    Set in torch as well as the environment: a rank forked from the preloaded server keeps the
    server's torch thread count whatever ``OMP_NUM_THREADS`` says now."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        threads = int(os.environ["OMP_NUM_THREADS"])
    except ValueError:
        return  # not a count: torch's own reading of it stands
    if threads > 0:
        torch.set_num_threads(threads)


def _check_fork_is_safe(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda._is_in_bad_fork():  # noqa: SLF001
        raise RuntimeError(
            "this rank was forked from a preloaded process that had initialised CUDA (a preloaded module "
            "did so at import); set PARITY_START_METHOD=spawn, or keep that module out of preload_modules()"
        )


def _answer(conn: Connection, kind: str, payload: object) -> None:
    _send(conn, pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))


def _send(conn: Connection, message: bytes) -> None:
    try:
        conn.send_bytes(message)
    except OSError:  # the parent is gone or has ended this rank's group: nobody is listening
        exit_without_teardown(_ORPHAN_EXIT_CODE)


# long: a rank process's whole life (join, serve calls, tear down) in the order it happens
def worker_main(
    rank: int,
    world_size: int,
    backend: str,
    device: str,
    meeting: tuple[str, int, str],
    startup_timeout: float,
    conn: Connection,
    stack_pipe: Connection,
    environ: Mapping[str, str],
) -> None:
    """Join the group, then run every ``(fn, args)`` the parent sends until it says stop or goes away.

    ``meeting`` is the rendezvous: the store's host and port and the prefix of this group's keys there."""
    _die_with_parent()
    _dump_stacks_to(stack_pipe)
    # Ctrl-C reaches the whole terminal process group; the parent handles it and ends us. (The
    # preloaded server was started with SIGINT blocked: ignored is what it inherits.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # A preloaded server was started with the parent's environment of then: use the parent's of now.
    os.environ.clear()
    os.environ.update(environ)
    _limit_threads()
    try:
        dev = torch.device(device)
        _check_fork_is_safe(dev)
        set_device(dev)
        host, port, prefix = meeting
        store: dist.Store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=startup_timeout))
        if prefix:
            store = dist.PrefixStore(prefix, store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    except BaseException:
        _answer(conn, ERR, traceback.format_exc())
        return
    _answer(conn, READY, None)

    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent died or ended the group: no clean destroy to wait for
            exit_without_teardown(_ORPHAN_EXIT_CODE)
        if message == STOP:
            break
        try:
            fn, args = pickle.loads(message)
            reply = pickle.dumps((OK, fn(*args)), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # SystemExit from fn is a failure of fn, reported with its traceback
            reply = pickle.dumps((ERR, traceback.format_exc()), protocol=pickle.HIGHEST_PROTOCOL)
        _send(conn, reply)
    dist.destroy_process_group()
    kill_descendants()  # what the calls started and left (a daemon in its own session too) ends with the rank
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> NoReturn:
    """Exit with ``code``, skipping the interpreter's teardown (a rank, once its group is destroyed).

    With torch loaded that teardown costs about a second per rank on a 2-core machine and frees
    nothing the OS does not. atexit hooks (e.g. coverage's) still run; threads left running are not
    waited for.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
