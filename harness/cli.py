"""The ``parity`` command line: wires one module per verb from ``harness.commands``.

Each verb module exposes ``register(subparsers)`` and ``run(args) -> int``; a verb is a module and
one name in :data:`VERBS`. Exit codes: 0 passed, 1 a failure or regression, 2 a usage or
configuration error, 3 an inconclusive timing with nothing failed, 130 on SIGINT and 143 on
SIGTERM: the signal unwinds the run like an exception, so every rank group is ended on the way out,
with one line instead of a traceback. The handlers are set first (nothing heavy is imported before
them); a signal during torch's import is raised as soon as the import is done. Under torchrun or srun
rank 0 alone parses and runs the verb (:func:`harness.ranks.run_as_job`) and every rank exits with
its code.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from harness.paths import parity_version

VERBS = (
    "init",
    "list",
    "check",
    "gate",
    "perf",
    "sweep",
    "matrix",
    "compare",
    "recalibrate",
    "bless",
    "doctor",
    "serve",
)

DESCRIPTION = """\
Numerical-parity and regression harness for sequence-parallel diffusion attention.

--json FILE writes a verb's machine output to FILE; --json - writes it to stdout (tables go to stderr).
exit codes: 0 all passed, 1 any failure, 2 usage or configuration error, 3 inconclusive timings
(gate, perf: nothing failed, but a timing verdict could not be decided).
project: the nearest parity.toml, or pyproject.toml with [tool.parity], from the working directory
upwards names the cases, baselines, targets, device and profile (`parity init` writes one; options
override it); without one, parity's own cases/ and baselines/ are used ($PARITY_HOME, else the
checkout of an editable install, else the read-only copy inside the installed package).
"""


def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(
        prog="parity", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"parity {parity_version()}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        importlib.import_module(f"harness.commands.{verb}").register(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``argv`` parsed, the ids a verb takes (``parity check A --world-size 2 B``) allowed after its options too,
    as pytest and git take them; anything else unrecognized is the verb's usage error, not the top level's."""
    args, extra = parser.parse_known_args(argv)
    verb = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.verb]
    ids = getattr(args, "ids", None)
    stray = [e for e in extra if e.startswith("-")]
    if extra and isinstance(ids, list) and not stray:
        ids.extend(extra)
    elif extra:
        verb.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def check_platform_env() -> None:
    """A PARITY_PLATFORM that names no platform is a configuration error before any verb runs (every
    platform branch reads it, in this process and in every rank)."""
    if not os.environ.get("PARITY_PLATFORM", "").strip():
        return  # unset: nothing to check, and no need to import torch through reference_impl.platform
    from harness.errors import ConfigError
    from reference_impl.platform import PLATFORM_ENV, PlatformSpecError, parse_platform_spec

    try:
        parse_platform_spec(os.environ[PLATFORM_ENV])
    except PlatformSpecError as exc:
        raise ConfigError(exc.reason, key=PLATFORM_ENV) from None


_UNWINDING_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A BaseException, like KeyboardInterrupt, so no ``except Exception``
    on the way swallows it while every ``with`` that holds rank groups ends them."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Unwinding:
    """The signal this run received (None: none yet), whether a line has said so, and whether raising
    :class:`Interrupted` may start (a signal before that is raised as soon as it may)."""

    signum: int | None = None
    reported = False
    armed = False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    for sig in _UNWINDING_SIGNALS:  # one unwinding, however many signals arrive during the cleanup
        signal.signal(sig, signal.SIG_IGN)
    _Unwinding.signum = signum
    if _Unwinding.armed:
        raise Interrupted(signum)


def _redeliver_unraisable(previous: Callable[[object], None]) -> Callable[[object], None]:
    """An ``sys.unraisablehook`` for the run: an :class:`Interrupted` raised where Python cannot propagate it
    (a ``__del__``, a weakref callback) would be printed as "Exception ignored in ..." and lost, so the run
    went on after Ctrl-C; instead the signal is delivered again from another thread once the hook returned,
    to be raised in the code that follows (again, should that be another ``__del__``)."""

    def hook(unraisable: object) -> None:
        exc = getattr(unraisable, "exc_value", None)
        if not isinstance(exc, Interrupted):
            previous(unraisable)
            return
        signal.signal(exc.signum, _on_signal)
        threading.Timer(0.01, os.kill, (os.getpid(), exc.signum)).start()

    return hook


@contextmanager
def _signals_unwind(exiting: bool) -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the block (signals reach the main thread only).
    ``exiting``: the process ends after the block, and they stay ignored until it has (its verdict stands
    and its cleanup finishes); else the previous handlers come back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _Unwinding.signum, _Unwinding.reported, _Unwinding.armed = None, False, False
    previous = {sig: signal.signal(sig, _on_signal) for sig in _UNWINDING_SIGNALS}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _redeliver_unraisable(previous_hook)
    try:
        yield
    finally:
        _Unwinding.armed = False
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if exiting else handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``parity VERB ...`` (``argv`` None: this process's command line, and the process exits after it)."""
    with _signals_unwind(exiting=argv is None):
        code = _exit_code("parity", lambda: _in_job(argv))  # what is left for a job rank but 0: the job's own errors
    if argv is None and _Unwinding.reported:
        _leave_after_signal(code)
    return code


def _leave_after_signal(code: int) -> None:
    """End the process after a signal without the interpreter's own exit: a group starting in the background may
    still be inside torch's C++ (its TCPStore), and destroying that at exit aborts the process ("terminate called
    without an active exception", SIGABRT instead of 128 + the signal). The exit hooks run first: every group is
    ended and every temporary folder removed, as at a normal exit."""
    atexit._run_exitfuncs()  # noqa: SLF001 - the hooks a normal exit runs, without its C++ static destructors
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _in_job(argv: Sequence[str] | None) -> int:
    with _signals_deferred():  # torch's import: C++ beneath it aborts on an exception raised in its Python calls
        from harness.ranks import run_as_job

    return run_as_job(lambda: _run_verb(argv))


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """A signal in the block is raised when it ends: SIGTERM during torch's import under load raised
    :class:`Interrupted` inside a Python call of torch's C++ initialisation, which then aborted (SIGABRT, a
    Python stack on stderr, 1 run in 32 of the signal sweep on a loaded box)."""
    armed, _Unwinding.armed = _Unwinding.armed, False
    try:
        yield
    finally:
        _Unwinding.armed = armed
    if armed and _Unwinding.signum is not None:
        raise Interrupted(_Unwinding.signum)


def _run_verb(argv: Sequence[str] | None) -> int:
    """Parse and run one verb (on rank 0 of a job); its exit code."""
    parser = build_parser()
    try:
        args = parse(parser, argv)
    except SystemExit as exc:  # argparse: --help exits 0, a usage error exits 2
        return int(exc.code or 0)

    def run() -> int:
        from harness.project import find_project, load_project
        from harness.ranks.starting import check_start_method_env
        from harness.report.output import check_outputs

        check_platform_env()
        check_start_method_env()
        check_outputs((getattr(args, "json", None), "--json"))  # every verb that writes JSON: before any work
        found = find_project(Path.cwd())
        args.project = load_project(found) if found is not None else None
        return int(args.run(args))

    return _exit_code(f"parity {args.verb}", run)


def _stopped(who: str, signum: int) -> int:
    if not _Unwinding.reported:
        _Unwinding.reported = True
        print(f"{who}: stopped by {signal.Signals(signum).name}; every rank was ended", file=sys.stderr)
    return 128 + signum


def _exit_code(who: str, run: Callable[[], int]) -> int:
    """``run()``'s exit code, an error or a signal mapped to its own (module docstring) and said in one line."""
    from harness.errors import ConfigError
    from harness.report.format import inert_lines

    try:
        _Unwinding.armed = True
        if _Unwinding.signum is not None:  # it came before it could be raised
            raise Interrupted(_Unwinding.signum)
        code = run()
    except ConfigError as exc:
        print(f"{who}: error: {inert_lines(exc)}", file=sys.stderr)
        code = 2
    except Interrupted as exc:
        return _stopped(who, exc.signum)
    except Exception as exc:
        if _Unwinding.signum is not None:  # a library caught the signal's exception and failed another way
            return _stopped(
                who, _Unwinding.signum
            )  # (numpy interrupted mid-import: "cannot load module more than once")
        control = sys.modules.get("harness.ranks.control")  # only raised once the ranks were imported
        if control is None or not isinstance(exc, control.JobLost):
            raise
        print(f"{who}: error: {inert_lines(exc)}", file=sys.stderr)
        code = 1
    if _Unwinding.signum is not None:  # swallowed on the way by something that caught it
        return _stopped(who, _Unwinding.signum)
    return code


if __name__ == "__main__":
    sys.exit(main())
