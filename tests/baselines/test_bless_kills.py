"""``parity bless`` killed at random moments always leaves a complete reference set: the old one or the new one.

A worker process runs ``parity bless --all --from-results`` in a loop, alternating between two
saved candidate sets A and B (different pixels, and a video of 4 frames in A but 2 in B, each
blessed with its own case file, so a bless also drops files). The test SIGKILLs it at random moments, a bounded number of times,
and after every kill loads every case through the gate's reader (no recovery run first): all
cases must come from A, or all from B. The directory state at each kill is recorded; the loop goes on
past its 24 kills until one landed mid-bless (a staging folder or a committed, half-moved set), as
on a loaded box most may fall between blesses.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from harness.baselines.image_writes import blessing, recover, write_set
from harness.baselines.images import PENDING, load_reference
from harness.cases.image import load_image_cases

REPO = Path(__file__).resolve().parents[2]
KILLS = 24
MAX_KILLS = 400  # on a loaded box most kills may fall between blesses: go on until one lands inside
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses SIGKILL"), pytest.mark.timeout(300)]

CASES = """\
[defaults]
prompt = "a kill loop"
height = 64
width = 64
steps = 1

[cases.img_a]
[cases.img_b]
[cases.vid]
num_frames = {frames}
"""
WORKER = """
import itertools, os, pathlib, sys
import harness.gate.bless, harness.metrics  # imported once here: each forked bless loop starts warm
from harness.cli import main
baselines, marker, *runs = sys.argv[1:]
for line in sys.stdin:  # one forked bless loop per line; the test SIGKILLs it
    pid = os.fork()
    if pid == 0:
        sys.stdout = open(os.devnull, "w")
        for i in itertools.count():
            source, cases = runs[2 * (i % 2):2 * (i % 2) + 2]
            assert main(["bless", "--all", "--from-results", source, "--cases", cases, "--baselines", baselines]) == 0
            pathlib.Path(marker).touch()
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def _sets(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    frames = 4 if seed == 0 else 2
    return {
        "img_a": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
        "img_b": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
        "vid": rng.integers(0, 256, (frames, 64, 64, 3), dtype=np.uint8),
    }


def _state(refs: Path) -> str:
    if any(refs.glob(".bless-*.tmp")):
        return "staged"
    if (refs / PENDING).exists():
        return "committed, moving"
    return "clean"


def test_sigkill_loop_over_bless_always_leaves_a_loadable_set(tmp_path: Path) -> None:
    baselines = tmp_path / "baselines"
    sets = [_sets(0), _sets(1)]
    runs = []
    for i, arrays in enumerate(sets):  # what two gate runs would have saved (the video's frame count differs)
        cases_root, source = tmp_path / f"cases{i}", tmp_path / f"run{i}"
        (cases_root / "images").mkdir(parents=True)
        (cases_root / "images" / "kill.toml").write_text(CASES.format(frames=len(arrays["vid"])))
        fields = {c.id: c.fields for c in load_image_cases(cases_root)}
        write_set(source / "candidates", [blessing(cid, a, fields[cid], 1, "reference") for cid, a in arrays.items()])
        runs += [source, cases_root]
        if i == 0:
            refs = baselines / "images"
            write_set(refs, [blessing(cid, a, fields[cid]) for cid, a in arrays.items()])

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    marker = tmp_path / "blessed-once"
    rng = random.Random(17)
    states: list[str] = []
    worker = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WORKER), str(baselines), str(marker), *map(str, runs)],
        env=env,
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdin is not None and worker.stdout is not None
    pid = None
    try:
        for _ in range(MAX_KILLS):  # repeats: one warm worker killed; each check guards the next kill
            if len(states) >= KILLS and states.count("clean") < len(states):
                break  # KILLS kills, one of them mid-bless at least
            marker.unlink(missing_ok=True)
            worker.stdin.write("bless\n")
            worker.stdin.flush()
            pid = int(worker.stdout.readline())
            deadline = time.monotonic() + 60
            while (
                not marker.exists()
            ):  # poll: one bless finished: the loop is warm, the next kill lands anywhere in a bless
                assert time.monotonic() < deadline, "the bless loop never finished a bless"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.2))
            os.kill(pid, signal.SIGKILL)
            assert worker.stdout.readline().strip() == "reaped"
            pid = None  # reaped: its number may belong to another process from now on
            states.append(_state(refs))
            loaded = {cid: load_reference(refs, cid) for cid in sets[0]}  # the gate's reader, no recovery first
            matches = [all(np.array_equal(loaded[cid], s[cid]) for cid in s) for s in sets]
            assert any(matches), f"kill {len(states)} ({states[-1]}) left a mixed set"
    finally:  # a failed assertion must not leave the forked bless or the worker behind
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        worker.stdin.close()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()

    mid_bless = len(states) - states.count("clean")
    print(f"{len(states)} SIGKILLs: " + ", ".join(f"{s}: {states.count(s)}" for s in sorted(set(states))))
    assert mid_bless > 0, f"no kill landed inside a bless: {states}"
    recover(refs)  # what the next bless does first
    assert _state(refs) == "clean" and sorted(p.name for p in refs.iterdir()) == [
        "img_a.png",
        "img_b.png",
        "manifest.json",
        "vid",
    ]
    frames = sorted(p.name for p in (refs / "vid").iterdir())
    assert frames == [
        f"frame_{i:04d}.png" for i in range(len(load_reference(refs, "vid")))
    ]  # no stray frame left behind


def test_a_staged_drop_list_deletes_only_reference_files(tmp_path: Path) -> None:
    """recover() deletes the files a committed set drops by name: a damaged list must not reach outside the set."""
    import json

    from harness.baselines.image_writes import recover
    from harness.baselines.images import PENDING
    from harness.errors import ConfigError

    outside = tmp_path / "keep.txt"
    outside.write_text("not a reference")
    references = tmp_path / "images"
    (references / PENDING).mkdir(parents=True)
    (references / PENDING / "dropped.json").write_text(json.dumps(["../keep.txt"]))
    with pytest.raises(ConfigError, match="not a reference file name: '../keep.txt'"):
        recover(references)
    assert outside.read_text() == "not a reference"


@pytest.mark.parametrize(
    ("case_id", "shape"),
    [("img", (8, 8, 3)), ("vid", (3, 8, 8, 3)), ("long", (10001, 2, 2, 3))],
    ids=["image", "video", "video-10001-frames"],
)
def test_a_reference_file_name_maps_to_its_case_as_reference_files_writes_it(
    case_id: str, shape: tuple[int, ...]
) -> None:
    """One rule for what a reference file is called, for the staged drop list and the format-1 manifest alike."""
    from harness.baselines.images import case_of_file, reference_files

    assert {case_of_file(name) for name in reference_files(case_id, shape)} == {case_id}


@pytest.mark.parametrize("name", ["img.txt", "vid/frame_1.png", "vid/frame_0000.png/x", "vid/other.png", "../keep.txt"])
def test_a_name_reference_files_never_writes_belongs_to_no_case(name: str) -> None:
    from harness.baselines.images import case_of_file

    assert case_of_file(name) is None
