"""Where machine-readable output goes: ``--json FILE`` writes FILE atomically, ``--json -`` writes stdout.

One convention for every verb. With ``-`` the JSON owns stdout, so the verb's tables and
messages go to stderr (:func:`human_console`) and ``parity VERB --json - | jq`` reads clean JSON.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from harness.errors import ConfigError
from harness.files.atomic import check_writable, dump_json, write_json_atomic
from harness.report.console import make_console

STDOUT = "-"
JsonTarget = Path | str  # a file, or STDOUT


def to_stdout(target: JsonTarget | None) -> bool:
    return target is not None and str(target) == STDOUT


def check_outputs(*outputs: tuple[JsonTarget | None, str]) -> None:
    """Refuse, before any work, each given output (``(path, flag)``) that cannot be written; ``-`` is stdout."""
    for path, flag in outputs:
        if path is not None and not to_stdout(path):
            check_writable(path, flag)


def emit_json(target: JsonTarget, obj: Any) -> None:
    """``obj`` as JSON (strict: no NaN) to ``target``: stdout for ``-``, else an atomic write of the file
    (a ConfigError naming it when that fails, e.g. the folder went away during the run)."""
    if to_stdout(target):
        sys.stdout.write(dump_json(obj) + "\n")
        sys.stdout.flush()
        return
    try:
        write_json_atomic(target, obj)
    except OSError as exc:
        raise ConfigError(f"cannot write: {exc.strerror or exc}", path=target, key="--json") from None


def human_console(target: JsonTarget | None) -> Console:
    """The console for tables and messages: stderr when the JSON goes to stdout."""
    return make_console(stderr=to_stdout(target))
