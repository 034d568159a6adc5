"""How rank processes start: forked from a preloaded server where the platform has one, spawned otherwise.

A spawned rank is a fresh interpreter importing torch and the target's stack (sglang: ~11 s of CPU)
once per rank of every group. multiprocessing's forkserver is a fresh interpreter too (never this
process, which may run threads or have initialised CUDA) that imports the preloaded modules once and
forks each rank in milliseconds. It starts with the first preloaded group and lives until this
process ends, so a module :func:`preload` learns of later is imported by each rank itself.
``PARITY_START_METHOD`` (or a group's ``start_method``) chooses; by default CPU ranks are forked and
CUDA ranks spawned (forking CUDA ranks is supported by torch but not yet run here on a GPU). A CUDA
rank forked from a server that initialised CUDA refuses to start and says so.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import resource_tracker
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

from harness.errors import ConfigError
from harness.ranks.server import RANKS_TMPDIR_ENV

PRELOADED, SPAWN = "forkserver", "spawn"
START_METHODS = (PRELOADED, SPAWN)
START_METHOD_ENV = "PARITY_START_METHOD"
BASE_PRELOAD = (
    "harness.ranks.server",
    "torch",
    "torch.distributed",
    "harness.ranks.worker",
)  # the server's set-up first

_lock = threading.Lock()
_preload: list[str] = list(BASE_PRELOAD)
# A rank's PR_SET_PDEATHSIG fires when the *thread* that started it exits, so spawned ranks are
# started from this one thread, which lives as long as the process (a pool's background start
# thread would take its ranks with it). Forked ranks are the server's children, whatever thread asked.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parity-rank-spawner")


def preload(modules: Iterable[str]) -> None:
    """Add modules for the preloaded server to import before it forks its first rank.

    Call it before the first group starts (the contract runner does, with the target's
    :meth:`~harness.targets.base.Target.preload_modules`). A module that fails to import there is
    skipped silently by the server; the rank that needs it then raises the real error.
    """
    with _lock:
        _preload.extend(m for m in modules if m not in _preload)


def preloaded_modules() -> tuple[str, ...]:
    with _lock:
        return tuple(_preload)


def start_method(device: str, requested: str | None = None) -> str:
    """``requested``, else ``$PARITY_START_METHOD``, else preloaded for CPU ranks and spawn for CUDA ranks;
    spawn where the platform cannot fork a server."""
    default = SPAWN if device.startswith("cuda") else PRELOADED
    method = requested or os.environ.get(START_METHOD_ENV) or default
    if method not in START_METHODS:
        source = "start_method" if requested else START_METHOD_ENV
        raise ValueError(f"{source}={method!r}: valid start methods are {', '.join(START_METHODS)}")
    if method == PRELOADED and PRELOADED not in multiprocessing.get_all_start_methods():
        return SPAWN  # e.g. Windows
    return method


def check_start_method_env() -> None:
    """A ``PARITY_START_METHOD`` that names no start method is a configuration error before any verb runs."""
    method = os.environ.get(START_METHOD_ENV)
    if method and method not in START_METHODS:
        raise ConfigError(f"{method!r} is not a start method; valid: {', '.join(START_METHODS)}", key=START_METHOD_ENV)


def start(proc: BaseProcess, method: str) -> None:
    """Start a rank process made by :func:`context` (``method``)."""
    if method == SPAWN:
        _spawner.submit(proc.start).result()
    else:
        _ensure_server()
        proc.start()


# Linux's sockaddr_un.sun_path holds 108 bytes, its NUL included; the server listens on
# <tempdir>/pymp-XXXXXXXX/listener-XXXXXXXX (8 random characters each).
_SUN_PATH_MAX = 108
_SOCKET_SUFFIX = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
_SHORT_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def _multiprocessing_temp_dir() -> str:
    """This process's multiprocessing folder, made where the server's socket path fits: under a TMPDIR too long
    for a Unix socket (a CI runner's or pytest's nested folders) ``bind`` fails with "AF_UNIX path too long", so
    the folder is made in the first writable short system folder instead, removed at exit as multiprocessing's own."""
    config = multiprocessing.process.current_process()._config  # noqa: SLF001 - where get_temp_dir keeps its folder
    base = tempfile.gettempdir()
    if config.get("tempdir") is None and len(base) + _SOCKET_SUFFIX >= _SUN_PATH_MAX:
        short = next((d for d in _SHORT_TEMP_DIRS if os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK)), None)
        if short is None:
            raise ConfigError(
                f"{base!r} is too long for the preloaded server's socket ({len(base)} characters; at most "
                f"{_SUN_PATH_MAX - _SOCKET_SUFFIX - 1}) and none of {', '.join(_SHORT_TEMP_DIRS)} is "
                f"writable: set a shorter TMPDIR, or {START_METHOD_ENV}=spawn",
                key="TMPDIR",
            )
        folder = tempfile.mkdtemp(prefix="pymp-", dir=short)
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
        config["tempdir"] = folder
    return multiprocessing.util.get_temp_dir()


def _ensure_server() -> None:
    """Start the preloaded server (if it is not running) with SIGINT blocked: a signal mask outlives exec, so a
    Ctrl-C in the server's first instants (before :mod:`harness.ranks.server` ignores it) cannot print a
    traceback there; here the SIGINT stays pending and is handled as soon as the server is started. The
    resource tracker starts first: starting it unblocks SIGINT and SIGTERM, whatever the mask was. The server is
    told the ranks' temporary folder (:mod:`harness.ranks.server`): inside this process's own, removed at its exit."""
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with _lock:  # groups start in threads of their own: one sets the variable, starts the server, removes it
            os.environ[RANKS_TMPDIR_ENV] = os.path.join(_multiprocessing_temp_dir(), "ranks")
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                del os.environ[RANKS_TMPDIR_ENV]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def context(method: str) -> BaseContext:
    """The multiprocessing context that starts ranks by ``method`` (the server's preload list kept current)."""
    ctx = multiprocessing.get_context(method)
    if method == PRELOADED:
        with _lock:  # read when the server starts, i.e. at the first rank it forks
            ctx.set_forkserver_preload(list(_preload))
    return ctx
