"""The ``command`` pipeline target: an external command that writes PNGs (and timings) into a folder parity gives it.

How a stack parity should not import is gated (a server's client, ``sglang generate``, another venv):
``--pipeline-target command --pipeline-target-arg template='gen --prompt {prompt} --out {out_dir}'``.
The template is split with ``shlex`` before any placeholder is filled and run without a shell, so a
value can never become shell syntax. It runs once per case from the gate's own process, never in a
rank group (W torch ranks would only hold the devices the command needs), under a keeper
(:mod:`harness.targets.command_run`) that kills everything it started. Placeholders, the PNG and
``timings.json`` contract (parity's or sglang's ``--perf-dump-path`` schema) and what fails a case:
docs/targets/pipelines.md.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import string
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import ConfigError, ParamError
from harness.files.jsonio import expect_object, read_json
from harness.files.png import decode_rgb_png
from harness.files.reading import lstat_kind, read_regular_bytes
from harness.targets.base import PipelineFailed, PipelineOutput, PipelineTarget, Timings
from harness.targets.command_run import run_command

BUILTINS = ("out_dir", "timings", "world_size", "device")  # placeholders parity fills
TIMINGS_FILE = "timings.json"
PARITY_TIMINGS = ("e2e_ms", "stages_ms", "denoise_step_ms")  # the keys of parity's timings schema
DEFAULT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: beyond it a timeout is a typo (and inf overflows every wait)
MAX_FORMAT_NUMBER = 1024  # the largest width or precision a placeholder's format spec may ask for
STDERR_TAIL_LINES = 40
_SCALARS = (str, int, float, bool)
SHAPE_FIELDS = ("height", "width", "num_frames")  # read by parity for the shape check; the template may omit them


def placeholders(argv: list[str]) -> set[str]:
    """The ``{name}`` fields of every argument (ParamError on ``template`` for a malformed one)."""
    names = set()
    for arg in argv:
        try:
            parsed = list(string.Formatter().parse(arg))
        except ValueError as exc:
            raise ParamError("template", f"bad placeholder in {arg!r}: {exc}") from None
        for _, name, spec, _ in parsed:
            if name is not None:
                if not name.isidentifier():
                    raise ParamError("template", f"placeholder {{{name}}} in {arg!r} is not a plain name")
                _check_spec(name, spec or "", arg)
                names.add(name)
    return names


def _check_spec(name: str, spec: str, arg: str) -> None:
    """A format spec without nested fields and without a width or precision that would allocate gigabytes."""
    if "{" in spec or "}" in spec:
        raise ParamError(
            "template", f"placeholder {{{name}:{spec}}} in {arg!r}: nested fields in a format spec are not allowed"
        )
    for number in re.findall(r"\d+", spec):
        if len(number) > 6 or int(number) > MAX_FORMAT_NUMBER:
            shown = number if len(number) <= 12 else number[:12] + "..."
            raise ParamError(
                "template",
                f"placeholder {{{name}:...}} in {arg!r}: width or precision {shown} is above {MAX_FORMAT_NUMBER}",
            )


class CommandPipelineTarget(PipelineTarget):
    """An external command template; runs in the gate's process (``runs_in_ranks`` False)."""

    name = "command"
    runs_in_ranks = False
    process_per_run = True

    def __init__(self, template: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.template = template
        self.timeout = timeout

    def _argv(self, fields: Mapping[str, Any]) -> list[str]:
        template = fields.get("template", self.template)
        if not isinstance(template, str) or not template.strip():
            raise ParamError(
                "template",
                "no command: the command target needs its argument template='...' (--pipeline-target-arg; in "
                "parity perf --head-arg or --base-arg; pipeline_target_args in parity.toml) or a case field template",
            )
        try:
            return shlex.split(template)
        except ValueError as exc:
            raise ParamError("template", f"cannot split {template!r} into arguments: {exc}") from None

    def check_case(self, fields: Mapping[str, Any], world_size: int) -> str:
        argv = self._argv(fields)
        used = placeholders(argv)
        if "out_dir" not in used:
            raise ParamError(
                "template", "the template must pass {out_dir}, the directory the command writes its PNGs to"
            )
        values = {k: v for k, v in fields.items() if k != "template"}
        for key, value in values.items():
            if key in BUILTINS:
                raise ParamError(key, f"set by parity (the {{{key}}} placeholder), not by a case")
            if key not in used and key not in SHAPE_FIELDS:
                raise ParamError(key, f"not a placeholder of the template ({shlex.join(argv)})")
            if not isinstance(value, _SCALARS):
                raise ParamError(key, f"must be a string, number or boolean, got {value!r}")
        for key in ("height", "width", *(("num_frames",) if "num_frames" in values else ())):
            value = values.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParamError(key, f"required: a positive int (the PNGs are checked against it), got {value!r}")
        for name in sorted(used - set(values) - set(BUILTINS)):
            raise ParamError(
                "template", f"placeholder {{{name}}} has no value: not a case field nor one of {', '.join(BUILTINS)}"
            )
        trial = {
            **values,
            "out_dir": "/out",
            "timings": f"/out/{TIMINGS_FILE}",
            "world_size": world_size,
            "device": "cpu",
        }
        for arg in argv:
            try:
                arg.format(**trial)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                raise ParamError("template", f"cannot fill {arg!r} with the case's values: {exc}") from None
        check_executable(argv[0])
        return "video" if "num_frames" in values else "image"

    def output_shape(self, fields: Mapping[str, Any]) -> tuple[int, ...]:
        return _shape(fields)

    def prepare(self, fields: Mapping[str, Any], device: str, world_size: int | None = None) -> _PreparedCommand:
        values = {k: v for k, v in fields.items() if k != "template"}
        return _PreparedCommand(
            self._argv(fields), {**values, "world_size": world_size or 1, "device": device}, self.timeout
        )


def _shape(fields: Mapping[str, Any]) -> tuple[int, ...]:
    """The output a case's fields ask for: ``(height, width, 3)``, frames first for a video."""
    frames = fields.get("num_frames")
    return (*((frames,) if frames else ()), fields["height"], fields["width"], 3)


def check_executable(program: str) -> None:
    """The command's program exists now, not only after the case's run started (a placeholder in it is left alone)."""
    if "{" in program:
        return
    found = program if os.sep in program else shutil.which(program)
    if found is None or not os.path.isfile(found) or not os.access(found, os.X_OK):
        where = "not an executable file" if os.sep in program else "not found on PATH"
        raise ParamError("template", f"{program!r}: {where}")


class _PreparedCommand:
    """One command line, run once per ``run()`` into a fresh directory."""

    def __init__(self, template: list[str], values: dict[str, Any], timeout: float) -> None:
        self.template, self.values, self.timeout = template, values, timeout
        self.shape = _shape(values)

    def run(self) -> PipelineOutput:
        """One run in a fresh folder: removed after a pass and after an interrupt (a signal ends the run: nothing is
        left), kept after a failure, whose message names it."""
        out_dir = Path(tempfile.mkdtemp(prefix="parity-command-"))
        try:
            argv = [
                arg.format(**self.values, out_dir=str(out_dir), timings=str(out_dir / TIMINGS_FILE))
                for arg in self.template
            ]
            wall_ms, tail = _run(argv, self.timeout, out_dir)
            try:
                output = read_pngs(out_dir, self.shape)
                timings, source = read_timings(out_dir, wall_ms)
            except PipelineFailed as exc:
                raise PipelineFailed(f"{exc.reason} (outputs kept in {out_dir})", tail) from None
        except PipelineFailed:
            raise
        except BaseException:
            shutil.rmtree(out_dir, ignore_errors=True)
            raise
        shutil.rmtree(out_dir, ignore_errors=True)
        return PipelineOutput(output, timings, {"command": Path(argv[0]).name, "timings": source})

    def close(self) -> None:
        """Nothing to release: every run cleans up after itself."""


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-STDERR_TAIL_LINES:])


def _run(argv: list[str], timeout: float, out_dir: Path) -> tuple[float, str]:
    """Run ``argv`` (:func:`harness.targets.command_run.run_command`); its own wall time in ms and the tail of
    its stderr (of its stdout when stderr is empty), or PipelineFailed with that tail."""
    where = f"{shlex.join(argv)} (outputs kept in {out_dir})"
    done = run_command(argv, timeout, out_dir)
    tail = _tail(done.stderr if done.stderr.strip() else done.stdout)
    if done.timed_out:
        raise PipelineFailed(f"command timed out after {timeout:g} s: {where}", tail)
    if done.returncode is None or done.wall_ms is None:
        raise PipelineFailed(f"{done.error}: {where}", tail)
    if done.returncode != 0:
        last = next((line for line in reversed(tail.splitlines()) if line.strip()), "no output")
        raise PipelineFailed(f"command exited with status {done.returncode} ({last.strip()[:200]}): {where}", tail)
    return done.wall_ms, tail


def _natural(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def _written_pngs(out_dir: Path) -> list[Path]:
    """Every ``*.png`` under ``out_dir``; a symlink among them (or a linked folder) is refused, never followed:
    an output that links to the blessed reference would pass as the reference itself."""
    found = []
    for folder, dirs, files in os.walk(out_dir):
        for name in [*dirs, *files]:
            path = Path(folder, name)
            if path.is_symlink() and (name in dirs or name.lower().endswith(".png")):
                raise PipelineFailed(
                    f"{path.relative_to(out_dir)} is a symlink (to {os.readlink(path)!r}): "
                    "the command must write its PNGs into {out_dir} itself"
                )
        found += [Path(folder, name) for name in files if name.lower().endswith(".png")]
    return sorted(found)


def read_pngs(out_dir: Path, shape: tuple[int, ...]) -> np.ndarray:
    """The image (``[H, W, 3]``) or frames (``[T, H, W, 3]``) the command wrote, checked against ``shape``."""
    files = _written_pngs(out_dir)
    want = shape[0] if len(shape) == 4 else 1
    if len(files) != want or len({f.parent for f in files}) > 1:
        found = ", ".join(str(f.relative_to(out_dir)) for f in files[:20]) or "none"
        raise PipelineFailed(
            f"expected {want} PNG{'s in one directory' if want > 1 else ''} under {{out_dir}}, found {found}"
            + (f" and {len(files) - 20} more" if len(files) > 20 else "")
        )
    arrays = []
    for path in sorted(files, key=_natural):
        try:  # foreign output: a regular file inside out_dir, the guarded decoder (signature, limits, 8-bit RGB)
            array = decode_rgb_png(read_regular_bytes(path, within=out_dir), path)
        except ConfigError as exc:
            raise PipelineFailed(f"{path.name}: {exc}") from None
        if array.shape != shape[-3:]:
            raise PipelineFailed(
                f"{path.name}: expected 8-bit RGB of shape {shape[-3:]}, got {array.dtype} {array.shape}"
            )
        arrays.append(array)
    return np.stack(arrays) if len(shape) == 4 else arrays[0]


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:  # NaN/inf: refused by read_json
        raise PipelineFailed(f"{TIMINGS_FILE}: {where} must be a non-negative number of ms, got {value!r}")
    return float(value)


def _sglang_entries(doc: dict[str, Any], key: str, named: bool) -> list[tuple[str, float]]:
    """``(name, ms)`` of an sglang perf dump list (``steps``: ``{"name", "duration_ms"}`` with a stage name,
    ``denoise_steps_ms``: ``{"step", "duration_ms"}``); anything else fails the run, naming the entry."""
    entries = doc.get(key, [])
    if not isinstance(entries, list):
        raise PipelineFailed(f"{TIMINGS_FILE}: {key} must be a list, got {type(entries).__name__}")
    out = []
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict) or "duration_ms" not in entry:
            raise PipelineFailed(f"{TIMINGS_FILE}: {where} must be an object with duration_ms")
        name = entry.get("name", "")
        if named and (not isinstance(name, str) or not name.strip()):
            raise PipelineFailed(f"{TIMINGS_FILE}: {where}.name must be a stage's name (a string), got {name!r}")
        out.append((name, _number(entry["duration_ms"], f"{where}.duration_ms")))
    return out


def read_timings(out_dir: Path, wall_ms: float) -> tuple[Timings, str]:
    """The run's timings and where they came from: ``{out_dir}/timings.json`` (parity's or sglang's schema)
    or, when nothing is there, the wall clock. Anything else there (a FIFO, a folder, a symlink) fails the run."""
    path = out_dir / TIMINGS_FILE
    if lstat_kind(path) == "nothing":
        return Timings(
            wall_ms, {}, [], "command wall time"
        ), "none: e2e is the command's wall time (start-up and loading included)"
    try:  # the project's one JSON reader, inside out_dir: bounded, strict (no NaN/Infinity), errors naming the file
        doc = expect_object(read_json(path, within=out_dir), path, "")
    except ConfigError as exc:
        raise PipelineFailed(str(exc)) from None
    if "e2e_ms" in doc:
        unknown = sorted(set(doc) - set(PARITY_TIMINGS))
        if unknown:
            raise PipelineFailed(
                f"{TIMINGS_FILE}: unknown key {unknown[0]!r} in parity's schema ({', '.join(PARITY_TIMINGS)})"
            )
        stages = doc.get("stages_ms", {})
        steps = doc.get("denoise_step_ms", [])
        if not isinstance(stages, dict) or not isinstance(steps, list):
            raise PipelineFailed(f"{TIMINGS_FILE}: stages_ms must be an object and denoise_step_ms a list")
        return Timings(
            _number(doc["e2e_ms"], "e2e_ms"),
            {str(k): _number(v, f"stages_ms.{k}") for k, v in stages.items()},
            [_number(v, f"denoise_step_ms[{i}]") for i, v in enumerate(steps)],
            "command timings.json",
        ), TIMINGS_FILE
    if "total_duration_ms" in doc:
        stages = {name: ms for name, ms in _sglang_entries(doc, "steps", named=True)}
        if len(stages) < len(doc.get("steps", [])):
            raise PipelineFailed(f"{TIMINGS_FILE}: steps names a stage twice")
        steps = [ms for _, ms in _sglang_entries(doc, "denoise_steps_ms", named=False)]
        return (
            Timings(_number(doc["total_duration_ms"], "total_duration_ms"), stages, steps, "sglang perf dump"),
            f"{TIMINGS_FILE} (sglang perf dump)",
        )
    raise PipelineFailed(
        f"{TIMINGS_FILE} has neither e2e_ms (parity's schema) nor total_duration_ms (sglang's perf dump)"
    )


def target_seconds(value: str | float, key: str) -> float:
    """A factory argument in seconds (a timeout): finite, in (0, a week]; a ConfigError naming it otherwise."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise ConfigError(
            f"{key} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}",
            key="--pipeline-target-arg",
        )
    return seconds


def factory(template: str | None = None, timeout: str | float = DEFAULT_TIMEOUT_S) -> CommandPipelineTarget:
    return CommandPipelineTarget(template, target_seconds(timeout, "timeout"))
