"""Hostile external commands through the ``command`` pipeline target: 0 tracebacks, 0 hangs, 0 wrong accepts,
0 processes left.

Each row is a small shell script run as the case's command (``sh -c SCRIPT sh {out_dir}``): it
writes one 8x8 PNG the honest way or not (a link to the blessed reference, an animated PNG, a
FIFO), floods its output, leaves processes behind in its own session or holding its stdout, or
outlives its timeout (ignoring SIGTERM too). The run must pass (honest output) or fail with a PipelineFailed
naming what was wrong. A pass proves it never waited on a pipe or a process its command left: those sleep
300 s, more than the case's timeout, so waiting would have ended in "timed out" (no wall clock asserted); in
every case no process the command started is left (found by an environment tag each inherits), and memory stays bounded while gigabytes go through its pipes.
"""

from __future__ import annotations

import io
import shlex
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pytest

from harness.files.png import encode_png
from harness.targets.base import PipelineFailed
from harness.targets.command_pipeline import CommandPipelineTarget
from tests.files.test_hostile_inputs import bounded_memory
from tests.ranks.procs import kill_tagged, tagged, wait_until_gone

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, setsid"),
]
TAG = "PARITY_HOSTILE_COMMAND_TAG"
PASS = None
HONEST = 'cp "$HOSTILE_PNG" "$1/out.png"'


def _json(text: str) -> str:
    """``printf`` of a JSON text, its braces as octal escapes (a brace in a template is a placeholder)."""
    return "printf '" + text.replace("{", "\\173").replace("}", "\\175") + "'"


# Timeouts a loaded 2-core box meets (one at load 18 took over 30 s for an honest copy and 60 s for a 1 GiB
# flood), still well under the 300 s its leftover processes sleep: waiting on one would end in "timed out".
SLACK_S, FLOOD_S = 120, 240
# (id, script ($1 is {out_dir}), timeout in seconds, None = passes, else what the failure says)
ROWS = [
    ("honest", HONEST, SLACK_S, PASS),
    ("png_symlink_to_the_reference", 'ln -s "$HOSTILE_PNG" "$1/out.png"', SLACK_S, "is a symlink"),
    (
        "png_in_a_linked_folder",
        'mkdir "$1/../elsewhere-$$"; cp "$HOSTILE_PNG" "$1/../elsewhere-$$/out.png"; '
        'ln -s "$1/../elsewhere-$$" "$1/sub"',
        SLACK_S,
        "is a symlink",
    ),
    (
        "png_hard_link_kept",
        'ln "$HOSTILE_PNG" "$1/out.png"',
        SLACK_S,
        PASS,
    ),  # a regular file inside out_dir: its bytes are judged
    ("png_fifo", 'mkfifo "$1/out.png"', SLACK_S, "a FIFO"),
    ("png_directory", 'mkdir "$1/out.png"', SLACK_S, "expected 1 PNG"),
    ("apng_of_300_frames", 'cp "$HOSTILE_APNG" "$1/out.png"', SLACK_S, "an animated PNG"),
    ("png_of_another_size", 'cp "$HOSTILE_BIG_PNG" "$1/out.png"', SLACK_S, "expected 8-bit RGB of shape (8, 8, 3)"),
    ("two_thousand_pngs", 'cd "$1" && for i in $(seq 2000); do : > "$i.png"; done', FLOOD_S, "and 1980 more"),
    ("stdout_3_GiB", f"head -c 3G /dev/zero; {HONEST}", FLOOD_S, PASS),
    ("stderr_1_GiB_then_failing", "head -c 1G /dev/zero >&2; exit 3", FLOOD_S, "exited with status 3"),
    ("background_process_holding_stdout", f"sleep 300 & {HONEST}", SLACK_S, PASS),
    ("own_session_holding_stdout", f"setsid sleep 300 & {HONEST}", SLACK_S, PASS),
    ("double_forked_daemon", f'(setsid sh -c "sleep 300 & sleep 300" &) ; {HONEST}', SLACK_S, PASS),
    (
        "daemon_closing_its_output",
        f'setsid sh -c "exec sleep 300 >/dev/null 2>&1 </dev/null" & {HONEST}',
        SLACK_S,
        PASS,
    ),
    ("outlives_its_timeout_in_its_own_session", f"setsid sleep 300 & {HONEST}; sleep 300", 2, "timed out after 2 s"),
    ("killed_by_a_signal", "kill -9 $$", SLACK_S, "exited with status -9"),
    ("ignores_sigterm_past_its_timeout", "trap '' TERM; sleep 300 & wait; sleep 300", 2, "timed out after 2 s"),
    ("daemon_ignoring_sigterm", f"setsid sh -c \"trap '' TERM; sleep 300\" & {HONEST}", SLACK_S, PASS),
    ("two_hundred_children_left", f"for i in $(seq 200); do sleep 300 & done; {HONEST}", SLACK_S, PASS),
    (
        "spawning_while_it_is_ended",
        f'setsid sh -c "while :; do sleep 300 & sleep 0.01; done" & {HONEST}',
        SLACK_S,
        PASS,
    ),
    ("timings_fifo", f'{HONEST}; mkfifo "$1/timings.json"', SLACK_S, "a FIFO"),
    ("timings_directory", f'{HONEST}; mkdir "$1/timings.json"', SLACK_S, "a directory"),
    ("timings_link_to_dev_zero", f'{HONEST}; ln -s /dev/zero "$1/timings.json"', SLACK_S, "a symlink to '/dev/zero'"),
    (
        "timings_link_to_a_valid_file",
        HONEST + "; " + _json('{"e2e_ms": 1}') + ' > "$1/../t-$$.json"; ln -s "$1/../t-$$.json" "$1/timings.json"',
        SLACK_S,
        "is a symlink",
    ),
    (
        "timings_unknown_key",
        HONEST + "; " + _json('{"e2e_ms": 1, "e2e_mss": 2}') + ' > "$1/timings.json"',
        SLACK_S,
        "unknown key 'e2e_mss'",
    ),
    ("timings_valid", HONEST + "; " + _json('{"e2e_ms": 1.5}') + ' > "$1/timings.json"', SLACK_S, PASS),
]


def _apng(frames: int) -> bytes:
    from PIL import Image

    images = [Image.fromarray(np.full((8, 8, 3), i % 256, np.uint8)) for i in range(frames)]
    out = io.BytesIO()
    images[0].save(out, format="PNG", save_all=True, append_images=images[1:])
    return out.getvalue()


@pytest.fixture
def hostile_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The files the scripts copy, an environment tag every process they start inherits; kept outputs in tmp_path."""
    (tmp_path / "ref.png").write_bytes(encode_png(np.full((8, 8, 3), 9, np.uint8)))
    (tmp_path / "big.png").write_bytes(encode_png(np.zeros((64, 64, 3), np.uint8)))
    (tmp_path / "anim.png").write_bytes(_apng(300))
    tag = uuid.uuid4().hex
    for name, value in (("HOSTILE_PNG", "ref.png"), ("HOSTILE_BIG_PNG", "big.png"), ("HOSTILE_APNG", "anim.png")):
        monkeypatch.setenv(name, str(tmp_path / value))
    monkeypatch.setenv(TAG, tag)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tag
    kill_tagged(TAG, tag)


@pytest.mark.parametrize(("script", "timeout", "expect"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_a_hostile_command_fails_or_passes_and_leaves_nothing(
    script: str, timeout: float, expect: str | None, hostile_env: str
) -> None:
    target = CommandPipelineTarget(shlex.join(["sh", "-c", script, "sh"]) + " {out_dir}", timeout)
    fields = {"height": 8, "width": 8}
    assert target.check_case(fields, 1) == "image"
    prepared = target.prepare(fields, "cpu", 1)
    try:
        with bounded_memory():  # 3 GiB through a pipe must not be kept
            output = prepared.run()
    except PipelineFailed as exc:
        assert expect is not PASS, f"an honest command failed: {exc.reason}\n{exc.detail}"
        assert expect in exc.reason, exc.reason
        assert len(exc.detail) <= 64 * 1024 + 4096  # a tail, not the flood
    else:
        assert expect is PASS, f"wrongly accepted (expected a failure saying {expect!r})"
        assert output.output.shape == (8, 8, 3)
    assert wait_until_gone(tagged(TAG, hostile_env), 5) == [], "a process the command started outlived the case"
