"""The body of one rank process started by :mod:`harness.ranks.launcher`.

Kept apart from the launcher so the parent-side bookkeeping and the child-side
loop can each be read on their own. The wire protocol is pickled tuples over a
``multiprocessing`` pipe: the parent sends ``pickle((fn, args))`` or ``b""``
(stop); the rank answers ``("ready", None)`` once, then ``("ok", result)`` or
``("err", traceback_text)`` per call.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import NoReturn

import torch
import torch.distributed as dist

READY, OK, ERR = "ready", "ok", "err"
STOP = b""
_PARENT_POLL_S = 0.5
_ORPHAN_EXIT_CODE = 70

_device: torch.device | None = None


def current_device() -> torch.device:
    """The device of the rank running in this process; an error outside a rank, so misuse is loud."""
    if _device is None:
        raise RuntimeError("rank_device() was called outside a rank started by harness.ranks")
    return _device


def has_device() -> bool:
    return _device is not None


def set_device(device: torch.device) -> None:
    """Record this process's rank device (the torchrun path of the launcher sets it too)."""
    global _device
    _device = device
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _exit_when_orphaned(parent_pid: int, store_path: str) -> None:
    """Exit as soon as the parent is gone: a rank stuck in ``fn`` never reads the pipe EOF itself.

    The rendezvous file is removed on the way out, since the parent that owned it cannot.
    """
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            try:
                os.unlink(store_path)
            except OSError:  # a peer got there first
                pass
            os._exit(_ORPHAN_EXIT_CODE)


def _limit_threads() -> None:
    """One intra-op thread per rank unless the user chose: N ranks on few cores otherwise oversubscribe."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def _answer(conn: Connection, kind: str, payload: object) -> None:
    conn.send_bytes(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))


def worker_main(
    rank: int,
    world_size: int,
    backend: str,
    device: str,
    store_path: str,
    conn: Connection,
    parent_pid: int,
) -> None:
    """Join the group, then run every ``(fn, args)`` the parent sends until it says stop or goes away."""
    # Ctrl-C reaches the whole terminal process group; the parent handles it and ends us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watchdog = threading.Thread(target=_exit_when_orphaned, args=(parent_pid, store_path), daemon=True)
    watchdog.start()
    _limit_threads()
    try:
        set_device(torch.device(device))
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    except BaseException:
        _answer(conn, ERR, traceback.format_exc())
        return
    _answer(conn, READY, None)

    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:  # the parent closed our pipe or died
            break
        if message == STOP:
            break
        try:
            fn, args = pickle.loads(message)
            reply = pickle.dumps((OK, fn(*args)), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # SystemExit from fn is a failure of fn, reported with its traceback
            reply = pickle.dumps((ERR, traceback.format_exc()), protocol=pickle.HIGHEST_PROTOCOL)
        conn.send_bytes(reply)
    dist.destroy_process_group()
    _exit_without_teardown()


def _exit_without_teardown() -> NoReturn:
    """Exit once the group is destroyed, skipping the interpreter's teardown.

    With torch loaded that teardown costs about a second per rank on a 2-core machine, a
    third of a fresh group's cost, and frees nothing the OS does not. atexit hooks (e.g.
    coverage's) still run; threads that ``fn`` left running are not waited for.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
